"""Service settings from `VLSERVE_*` environment variables (or keyword overrides), validated at start-up."""
from __future__ import annotations

import difflib
import inspect
import ipaddress
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, urlparse

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MiB = 1 << 20
DEFAULT_BODY_BYTES_IN_FLIGHT = 256 * MiB  # max_body_bytes_in_flight when unset (or max_body_bytes, where larger)
ENV_PREFIX = "VLSERVE_"
# VLSERVE_* variables that are not settings: read by the CLI (PROFILE: the model set `vlserve serve` serves without
# model directories), by the model code (CACHE: the cache root; PACK_CPU_WEIGHTS: models/layers.py), and by the
# project's tooling (docker/, loadtests/); any other VLSERVE_* variable is a misspelt setting (unknown_variables)
OTHER_VARIABLES = frozenset({"CACHE", "PROFILE", "PACK_CPU_WEIGHTS", "DOCKER_CACHE", "IMAGE", "BASE", "WHEEL_CACHE",
                             "REHEARSAL_MODELS", "LOCUST_VENV", "API_KEY"})
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
# The most max_candidates may be: the schema's own bound, so that a list of a million ids is one error, not a million
MAX_CANDIDATES = 10_000
LOG_FORMATS = ("text", "json")  # service.logs writes each
# the text format's line, the service's and every other command's (vlserve.cli)
LOG_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
# Redis refuses an expiry past 2**63 - 1 ms since the epoch: SET EX above (2**63 - 1) // 1000 - now seconds fails with
# "invalid expire time" (Redis 7.0: 9223370241022293 s on 2026-11-28, falling by a second a second); 9e15 s stays
# below that for millions of years
REDIS_MAX_TTL_S = 9 * 10**15
# Upper bounds of the time settings (every float setting is also finite): a batch that waits 10 s to fill, a queue of
# 10 minutes ahead of a request, or a body timeout or shutdown phase of an hour is no deliberate setting but a slip
# (seconds given to a _ms setting, a stray exponent), and it would be served as such
MAX_BATCH_WAIT_MS = 10_000.0
MAX_QUEUE_WAIT_MS = 600_000.0
MAX_TIMEOUT_S = 3600.0
_CREDENTIALS = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^/\s:@]*:)[^@\s]*@|(\bpassword=)[^&\s'\"]*")


class Settings(BaseSettings):
    """Everything `vlserve serve` can be told; every field is `VLSERVE_<NAME>` in the environment."""

    # allow_inf_nan off: "inf" or "nan" is no duration (an infinite max_wait_ms turned every 429 into a 500)
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", allow_inf_nan=False)

    # models
    model_dir: Path | None = None  # encoder checkpoint directory; None = the demo model
    detector_dir: Path | None = None  # detector directory; None = the demo model's detector
    runtime: Literal["torch", "onnxruntime", "tensorrt"] = "torch"  # inference backend
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    threads: int = Field(2, ge=1)  # intra-op threads of the inference runtime
    # torch runtime arithmetic: "bf16" runs the encoder's GEMMs and attention in bfloat16 (float32 LayerNorm and
    # residuals, as training's autocast) and a butd detector's res5 in bfloat16 (its own feature-cache namespace);
    # "auto" = bf16 where the hardware has native bfloat16 (AVX512-BF16/AMX CPUs, bf16 GPUs)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # a butd detector with res5 in bfloat16 chooses float32's regions: the proposals whose part in the choice lies
    # within bfloat16's error are recomputed in float32 (ButdRoIHeads.settle; its cost, and how often unsettled regions
    # differ from float32's: docs/BENCHMARKS.md). False: every score bfloat16's, faster. Each choice has its own
    # feature-cache namespace
    detector_settle: bool = True
    engine_cache_dir: Path | None = None  # onnxruntime's TensorRT engine cache; None = ~/.cache/vlserve/tensorrt
    # feature store
    # redis://[[user]:password@]host:port/db, rediss:// (TLS) or unix://path, as redis-py reads it; None or "" =
    # in-process LRU
    redis_url: str | None = Field(None, repr=False)
    # how long a cached image's regions stay in Redis after any pod last used them (a week); at most REDIS_MAX_TTL_S
    redis_ttl_s: int = Field(604800, gt=0, le=REDIS_MAX_TTL_S)
    # connections to Redis per process; a lookup waits for a free one rather than failing (feature_store.RedisStore)
    redis_max_connections: int = Field(32, ge=1)
    # in-process feature store bound, in bytes of stored values; with Redis, the pod's local tier in front of it
    # (0 = none: every lookup asks Redis); without Redis it is the store and must be > 0
    cache_max_bytes: int = 256 * MiB
    stream_cache_max_bytes: int = Field(256 * MiB, ge=0)  # two-stream retrieval: cached text/image states (torch); 0 = off
    query_bank_max_images: int = Field(100_000, ge=1)  # images whose query-bank prior (one float) each pod keeps
    # POST /images also computes the image's query-bank prior, in the background, so that the first text -> image
    # /retrieve that ranks it does not wait for it (its 256 bank rows); off: the first such request computes it
    query_bank_on_register: bool = True
    # batching (encoder, per task)
    # requests per encoder batch. On the CPU a batch's time grows almost linearly with its rows (the demo encoder on 2
    # cores: 8 rows in 15-18 ms, 32 in 42-49 ms), so batches past 8 add little throughput and much latency: at 4x
    # overload batches of 32 held accepted requests 3-6x longer than 8 clients wait, batches of 8 1.4-1.9x
    # (docs/RELIABILITY.md, Overload). A GPU, whose batch time grows slowly with rows, wants more
    max_batch_size: int = Field(8, ge=1)
    # while the runtime is busy, how long a batch may wait to fill (idle: none)
    max_wait_ms: float = Field(5.0, ge=0, le=MAX_BATCH_WAIT_MS)
    max_queue: int = Field(256, ge=1)  # queued requests per batcher before 429
    # admission control: a request that the batches queued ahead of it on the encoder (those it cannot join, at the
    # measured batch time) would hold longer than this gets 429 + Retry-After at once; 0 = max_queue only. The default
    # takes a request only while it can join the next batch (or queue behind batches shorter than 5 ms, a GPU's):
    # one full batch ahead doubles what an accepted request waits (docs/RELIABILITY.md, Overload)
    max_queue_wait_ms: float = Field(5.0, ge=0, le=MAX_QUEUE_WAIT_MS)
    # batching (detector)
    detector_max_batch_size: int = Field(8, ge=1)  # images per detector batch (1 where batching gains nothing:
    # app.detector_batch_size)
    # while the detector is busy, how long a batch may wait to fill
    detector_max_wait_ms: float = Field(5.0, ge=0, le=MAX_BATCH_WAIT_MS)
    # admission to the detector: a new image whose detection would wait longer than this behind the images queued
    # ahead of it (at the measured detector batch time) gets 429 + Retry-After before it is decoded; 0 = max_queue
    # only. Without it a pod took max_queue (256) new images for a detector that runs one at a time: the
    # bottom-up-attention frcnn-vg at 2.6 s a photo on 2 cores queued minutes of work (30 concurrent first /vqa were
    # all taken), far past any client's timeout and the shutdown's. 10 s takes about 4 photos queued there;
    # the demo detector (about 20 ms a photo, in batches of 8) is never refused below max_queue
    detector_max_queue_wait_s: float = Field(10.0, ge=0, le=MAX_QUEUE_WAIT_MS / 1000)
    # request limits
    max_body_bytes: int = Field(10 * MiB, gt=0)  # larger request bodies get 413
    # the bytes of request bodies held at once, summed over requests from their first byte to their answer: a
    # request whose body would pass it gets 429 + Retry-After, so that many bodies arriving slowly cannot hold memory
    # without bound; 0 = unbounded, else at least max_body_bytes; unset: 256 MiB, or max_body_bytes where larger
    max_body_bytes_in_flight: int | None = Field(None, ge=0)
    # a request body that sends no byte for this long gets 408
    body_timeout_s: float = Field(30.0, gt=0, le=MAX_TIMEOUT_S)
    # a request body not complete this long after its request began gets 408, however steadily it trickles in: the
    # bodies held at once are bounded (max_body_bytes_in_flight), and without a deadline a few clients sending a
    # byte a second could hold that bound for ever and every upload would be refused (10 MiB at 100 KB/s: 105 s)
    body_max_s: float = Field(180.0, gt=0, le=MAX_TIMEOUT_S)
    # a request's head (request line and headers) larger than this gets 431 and its connection closed
    max_head_bytes: int = Field(64 * 1024, ge=1024, le=16 * MiB)
    # a request's head not complete this long after its connection opened (on a kept-alive connection, after its
    # first byte) gets 408; a connection that sent no byte of one is closed (service/http_protocol.py)
    head_timeout_s: float = Field(10.0, gt=0, le=MAX_TIMEOUT_S)
    max_pixels: int = Field(40_000_000, gt=0)  # larger images are refused before decoding (decompression bombs)
    # memory of image decoding: pixels of images being decoded or waiting for their detector batch, summed over
    # concurrent requests (a request waits for room; one image larger than this decodes alone), at about 4 bytes
    # per pixel while decoding; large decodes then return freed heap to the OS. 0 = unbounded and no heap trimming
    decode_max_pixels_in_flight: int = Field(80_000_000, ge=0)
    # images longer than twice the detector's max_size decode reduced to that (JPEG at 1/2-1/8 scale, others
    # downscaled right after decoding); boxes and image_hw stay in the original image's pixels. False: full size
    decode_reduced: bool = True
    max_text_chars: int = Field(512, gt=0)  # longest question / expression / caption, in characters
    max_text_tokens: int = Field(64, ge=4)  # WordPiece budget of one text row ([CLS] text [MASK] [SEP] needs 4);
    # served as at most the checkpoint's text positions (app.text_token_limit)
    max_top_k: int = Field(100, ge=1)  # largest top_k a request may ask for
    max_candidates: int = Field(100, ge=1, le=MAX_CANDIDATES)  # most image_ids / texts one retrieval request may rank
    # access
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)  # empty = no auth; env: comma-separated
    # the proxies trusted to say who their client is (X-Forwarded-For, X-Forwarded-Proto), comma-separated IPs or
    # networks, or "*": the access log's client is then the proxy's client; unset or empty = those headers are
    # ignored (any client could write them)
    forwarded_allow_ips: str | None = None
    # server
    host: str = "127.0.0.1"  # bind address
    port: int = Field(8000, ge=0, le=65535)  # bind port (0 = any free port)
    # on SIGTERM, how long /readyz answers 503 while requests are still served (each answer closing its connection),
    # so that load balancers stop routing here before the listener closes; a second signal ends it early
    shutdown_drain_s: float = Field(5.0, ge=0, le=MAX_TIMEOUT_S)
    shutdown_timeout_s: float = Field(30.0, ge=0, le=MAX_TIMEOUT_S)  # after the drain, grace for in-flight requests
    log_level: Literal[LOG_LEVELS] = "info"  # the server's log level (uvicorn's levels), vlserve's lines and uvicorn's
    log_format: Literal[LOG_FORMATS] = "text"  # "text" (time, level, logger, message) or "json" (one object a line)

    @field_validator("model_dir", "detector_dir", "engine_cache_dir", mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():  # Path("") is ".": the working directory, never meant
            raise ValueError("is empty; give a directory, or unset it for the default")
        return value

    @field_validator("model_dir", "detector_dir")
    @classmethod
    def _existing_dir(cls, value: Path | None) -> Path | None:
        try:
            found = value is None or value.is_dir()
        except OSError as exc:  # a folder above it cannot be entered (e.g. a volume mounted 0700 for another user)
            raise ValueError(f"cannot read {value} ({exc.strerror}): make the model files readable by this process "
                             f"(chmod -R a+rX on the folder that holds them)") from None
        if not found:
            raise ValueError(f"directory not found: {value}")
        return value

    @field_validator("max_body_bytes_in_flight")
    @classmethod
    def _body_budget(cls, value: int | None, info: ValidationInfo) -> int:
        body = info.data.get("max_body_bytes")
        if value is None:
            return max(DEFAULT_BODY_BYTES_IN_FLIGHT, body or 0)
        if 0 < value and body is not None and value < body:
            raise ValueError(f"{value} is less than max_body_bytes ({body}): a body of the largest size allowed would "
                             "always be refused; set at least that, or 0 for no bound")
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        value = value.strip().lower()
        if not _DEVICE.match(value):
            raise ValueError(f"{value!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'")
        return value

    @field_validator("redis_url", mode="before")
    @classmethod
    def _redis_url(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip()
            if not value:
                return None  # VLSERVE_REDIS_URL="" turns Redis off
            if not value.startswith(_REDIS_SCHEMES):
                raise ValueError(f"{redact_url(value)!r} is not a Redis URL; it must start with "
                                 f"{', '.join(_REDIS_SCHEMES)}")
            why = redis_url_error(value)
            if why:
                raise ValueError(f"{redact_url(value)!r} is not a valid Redis URL: {why}")
        return value

    @field_validator("cache_max_bytes")
    @classmethod
    def _cache_bound(cls, value: int, info: ValidationInfo) -> int:
        no_redis = "redis_url" in info.data and not info.data["redis_url"]
        if value < 0 or (value == 0 and no_redis):
            raise ValueError("must be greater than 0 (0, no in-process tier in front of Redis, only with "
                             "VLSERVE_REDIS_URL)")
        return value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        """"a, b,c" -> ["a", "b", "c"]; blanks dropped, duplicates kept once. "" (or nothing but spaces) is no keys:
        an open service; a value with separators but no key (" , ,") is refused, as it would open the service too."""
        if isinstance(value, str):
            if not value.strip():
                return []
            value = value.split(",")
        if isinstance(value, (list, tuple)):
            keys = [k.strip() if isinstance(k, str) else k for k in value]
            kept = list(dict.fromkeys(k for k in keys if k != ""))
            if value and not kept:
                raise ValueError("set but holds no key (only commas and blanks), which would leave the service open; "
                                 "give at least one key, or unset it for a service without keys")
            return kept
        return value

    @field_validator("api_keys")
    @classmethod
    def _no_inner_space(cls, keys: list[str]) -> list[str]:
        for i, key in enumerate(keys):
            if any(c.isspace() for c in key):
                raise ValueError(f"API key #{i + 1} contains whitespace")
        return keys

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _proxy_addresses(cls, value: str | None) -> str | None:
        """Networks as uvicorn reads them: "10.0.0.1/8" is 10.0.0.0/8 (uvicorn would take it for a host name and
        trust nothing), and * alone (uvicorn trusts everyone only where the value is exactly *)."""
        items = [item.strip() for item in (value or "").split(",") if item.strip()]
        if not items:
            return None
        if "*" in items:
            if len(items) > 1:
                raise ValueError("* trusts every address: give it alone, or addresses and networks without it")
            return "*"
        networks = []
        for item in items:
            try:
                networks.append(str(ipaddress.ip_network(item, strict=False)))
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network (e.g. 10.0.0.0/8), nor *") from None
        return ",".join(networks)

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("host must not be empty")
        return value.strip()


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment, keyword overrides winning; raises pydantic.ValidationError."""
    return Settings(**overrides)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One warning per VLSERVE_* variable in `environ` that is neither a setting nor one of OTHER_VARIABLES (a
    misspelt setting is otherwise ignored without a word), naming the setting it most resembles."""
    settings = [name.upper() for name in Settings.model_fields]
    warnings = []
    for variable in sorted(environ):
        name = variable[len(ENV_PREFIX):] if variable.upper().startswith(ENV_PREFIX) else None
        if name is None or name.upper() in settings or name.upper() in OTHER_VARIABLES:
            continue
        close = difflib.get_close_matches(name.upper(), settings, n=1, cutoff=0.75)
        hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
        warnings.append(f"{variable} is not a setting and is ignored{hint}")
    return warnings


def redact_url(text: str) -> str:
    """text with the password of every URL in it (`scheme://user:PASSWORD@`, `?password=`) shown as ***."""
    return _CREDENTIALS.sub(lambda m: f"{m.group(1)}***@" if m.group(1) else f"{m.group(2)}***", text)


def redis_url_error(url: str) -> str | None:
    """Why redis-py cannot connect with this URL (port, IPv6 brackets, query options, db), or None."""
    from redis.asyncio.connection import parse_url  # what feature_store.RedisStore connects with

    try:
        parse_url(url)
    except (ValueError, TypeError) as exc:
        return str(exc)
    scheme = url.split("://", 1)[0]
    accepted = redis_query_options(scheme)
    unknown = [name for name in parse_qs(urlparse(url).query) if name not in accepted]
    if unknown:
        return (f"redis-py takes no query option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                f"in a {scheme}:// URL; it takes {', '.join(sorted(accepted))}")
    path = urlparse(url).path
    if not url.startswith("unix://") and path.strip("/") and not path.strip("/").isdigit():
        return f"the database must be a number (/0), not {path!r}"  # redis-py would silently use db 0
    return None


def redis_query_options(scheme: str) -> frozenset[str]:
    """The query options a redis://, rediss:// or unix:// URL may carry. redis-py's from_url hands each one to the
    connection pool feature_store.RedisStore uses and on to the scheme's connection class, converted where
    URL_QUERY_ARGUMENT_PARSERS names a parser and as text otherwise: a name neither accepts fails at the first
    connection (an unexpected keyword argument), and text for a parameter that takes none and has no parser is a
    wrong value (decode_responses=False would arrive as a true string)."""
    from redis.asyncio import connection as rc

    classes = {"rediss": rc.SSLConnection, "unix": rc.UnixDomainSocketConnection}.get(scheme, rc.Connection)
    accepted = set()
    for cls in (*rc.BlockingConnectionPool.__mro__, *classes.__mro__):
        if "__init__" not in vars(cls):
            continue
        for name, param in inspect.signature(cls.__init__).parameters.items():
            if name == "self" or param.kind not in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD):
                continue
            if name in rc.URL_QUERY_ARGUMENT_PARSERS or _takes_text(param.annotation):
                accepted.add(name)
    return frozenset(accepted)


def _takes_text(annotation: Any) -> bool:
    """Whether a parameter annotated so takes a str (str, str | None, Union[str, ...]; a string annotation by name)."""
    if isinstance(annotation, str):
        return re.search(r"(?<![\w.])str\b", annotation) is not None
    return annotation is str or str in typing.get_args(annotation)


def settings_error_message(error: ValidationError) -> str:
    """One readable message for a failed start-up: `invalid settings: VLSERVE_THREADS: ...; VLSERVE_PORT: ...`;
    passwords in URLs are masked."""
    parts = []
    for e in error.errors():
        field = ".".join(str(p) for p in e["loc"]) or "settings"
        name = f"VLSERVE_{field.upper()}" if e["loc"] and isinstance(e["loc"][0], str) else field
        msg = e["msg"].removeprefix("Value error, ")
        given = e.get("input")
        shown = "" if isinstance(given, dict) or field == "api_keys" else f" (got {given!r})"
        parts.append(redact_url(f"{name}: {msg}{shown}"))
    return "invalid settings: " + "; ".join(parts)
