"""`vlserve serve`: run the HTTP service with uvicorn; every option overrides one VLSERVE_* setting."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from service.settings import DEFAULT_BODY_BYTES_IN_FLIGHT, MiB
from vlserve.commands.zoo import PROFILE_HELP

_S = "Settings"  # help panel: every option is also an environment variable VLSERVE_<OPTION>


def _opt(help_text: str, panel: str = _S, **kw: Any) -> Any:
    return typer.Option(help=help_text, rich_help_panel=panel, show_default=False, **kw)


def _default(name: str) -> str:
    """"(default X)" for a setting, read from service.settings.Settings, where each default is defined."""
    from service.settings import Settings

    value = Settings.model_fields[name].default
    if isinstance(value, bool):
        text = "on" if value else "off"
    elif isinstance(value, int) and value >= MiB and value % MiB == 0:
        text = f"{value // MiB} MiB"
    elif isinstance(value, float) and value.is_integer():
        text = str(int(value))
    else:
        text = str(value)
    return f"(default {text})"


def serve(
    ctx: typer.Context,
    model_dir: Annotated[Path | None, _opt("encoder checkpoint directory (env VLSERVE_MODEL_DIR); with no model or detector given, "
                                           "the --profile model set is used (built on first use)", "Models")] = None,
    detector_dir: Annotated[Path | None, _opt("detector directory (env VLSERVE_DETECTOR_DIR)", "Models")] = None,
    profile: Annotated[str | None, _opt("with no --model-dir or --detector-dir: the model set of `vlserve zoo build --profile` "
                                        f"to serve from the cache, built there on first use: {PROFILE_HELP} "
                                        "(env VLSERVE_PROFILE; default demo)", "Models", envvar="VLSERVE_PROFILE")] = None,
    runtime: Annotated[str | None, _opt("inference backend: torch, onnxruntime or tensorrt " + _default("runtime"), "Models")] = None,
    device: Annotated[str | None, _opt("cpu, cuda or cuda:N " + _default("device"), "Models")] = None,
    threads: Annotated[int | None, _opt("intra-op threads of the runtime " + _default("threads"), "Models")] = None,
    precision: Annotated[str | None, _opt("torch's arithmetic, for the torch runtime's encoder and a bottom-up-"
                                          "attention detector's res5 (an exported repository's encoder runs its "
                                          "graphs' precision): fp32, bf16 (GEMMs and attention in bfloat16, float32 "
                                          "LayerNorm and residuals), or auto = bf16 where the CPU/GPU has native "
                                          "bfloat16 " + _default("precision"), "Models")] = None,
    detector_settle: Annotated[bool | None, _opt("bottom-up-attention detector with bf16 res5: recompute in fp32 the "
                                                 "proposals whose part in the choice lies within bf16's error, so the "
                                                 "regions are fp32's; off: faster, a region or two may differ "
                                                 + _default("detector_settle"), "Models")] = None,
    engine_cache_dir: Annotated[Path | None, _opt("TensorRT engine cache on a GPU (env VLSERVE_ENGINE_CACHE_DIR; runtime tensorrt, "
                                                  "or onnxruntime with its TensorRT provider): engines built once are reused "
                                                  "across restarts (default $XDG_CACHE_HOME/vlserve/tensorrt, else "
                                                  "~/.cache/vlserve/tensorrt)", "Models")] = None,
    redis_url: Annotated[str | None, _opt("feature store in Redis (redis://[:password@]host:port/db, rediss:// for TLS, "
                                           "unix://path); empty = in-process LRU. A wrong password or db index stops "
                                           "start-up; an unreachable Redis is a warning", "Feature store")] = None,
    redis_ttl_s: Annotated[int | None, _opt("how long cached regions stay in Redis after any pod last used them, "
                                              "seconds, at most 9e15 (Redis's limit) " + _default("redis_ttl_s"),
                                              "Feature store")] = None,
    redis_max_connections: Annotated[int | None, _opt("connections to Redis per process; a lookup waits for a free one "
                                                      "rather than failing " + _default("redis_max_connections"),
                                                      "Feature store")] = None,
    cache_max_bytes: Annotated[int | None, _opt("in-process feature store bound in bytes; with Redis the pod's tier "
                                                "in front of it, 0 = none " + _default("cache_max_bytes"),
                                                "Feature store")] = None,
    stream_cache_max_bytes: Annotated[int | None, _opt("two-stream presets on the torch runtime: bytes of per-image and "
                                                       "per-text encoder states /retrieve keeps; 0 = off " + _default("stream_cache_max_bytes"),
                                                       "Feature store")] = None,
    query_bank_max_images: Annotated[int | None, _opt("images whose query-bank prior (one float each) the process keeps "
                                                      + _default("query_bank_max_images"), "Feature store")] = None,
    query_bank_on_register: Annotated[bool | None, _opt("POST /images also computes the image's query-bank prior in the "
                                                        "background, so its first text -> image /retrieve does not wait "
                                                        "for it " + _default("query_bank_on_register"),
                                                        "Feature store")] = None,
    max_batch_size: Annotated[int | None, _opt("requests per encoder batch; 1 turns batching off " + _default("max_batch_size"), "Batching")] = None,
    max_wait_ms: Annotated[float | None, _opt("while the encoder is busy, how long a batch may wait to fill, ms; an idle "
                                              "encoder runs a request at once " + _default("max_wait_ms"), "Batching")] = None,
    max_queue: Annotated[int | None, _opt("queued requests per batcher before 429 " + _default("max_queue"), "Batching")] = None,
    max_queue_wait_ms: Annotated[float | None, _opt("a request that the batches queued ahead of it on the encoder would "
                                                    "hold longer than this gets 429 at once, ms; 0 = max_queue only "
                                                    + _default("max_queue_wait_ms"), "Batching")] = None,
    detector_max_batch_size: Annotated[int | None, _opt("images per detector batch " + _default("detector_max_batch_size"), "Batching")] = None,
    detector_max_wait_ms: Annotated[float | None, _opt("while the detector is busy, how long a batch may wait to fill, ms "
                                                       + _default("detector_max_wait_ms"), "Batching")] = None,
    detector_max_queue_wait_s: Annotated[float | None, _opt("a new image whose detection would wait longer than this "
                                                            "behind the images queued ahead gets 429 before it is "
                                                            "decoded, s; 0 = off " + _default("detector_max_queue_wait_s"),
                                                            "Batching")] = None,
    max_body_bytes: Annotated[int | None, _opt("larger request bodies get 413 " + _default("max_body_bytes"), "Limits")] = None,
    max_body_bytes_in_flight: Annotated[int | None, _opt("request bodies held at once, summed over requests; a body "
                                                         "that would pass it gets 429; 0 = unbounded (default "
                                                         f"{DEFAULT_BODY_BYTES_IN_FLIGHT // MiB} MiB, or "
                                                         "--max-body-bytes where larger)", "Limits")] = None,
    body_timeout_s: Annotated[float | None, _opt("a request body that sends no byte for this long gets 408, s "
                                                 + _default("body_timeout_s"), "Limits")] = None,
    body_max_s: Annotated[float | None, _opt("a request body not complete this long after its request began gets "
                                             "408, s " + _default("body_max_s"), "Limits")] = None,
    max_head_bytes: Annotated[int | None, _opt("a request head (request line and headers) larger than this gets 431 "
                                               + _default("max_head_bytes"), "Limits")] = None,
    head_timeout_s: Annotated[float | None, _opt("a request head not complete this long after its connection opened "
                                                 "gets 408 (a connection that sent nothing is closed), s "
                                                 + _default("head_timeout_s"), "Limits")] = None,
    max_pixels: Annotated[int | None, _opt("larger images are refused before decoding " + _default("max_pixels"), "Limits")] = None,
    decode_max_pixels_in_flight: Annotated[int | None, _opt("pixels of images being decoded or waiting for the detector, "
                                                            "summed over requests (about 4 bytes each while decoding); "
                                                            "0 = unbounded " + _default("decode_max_pixels_in_flight"), "Limits")] = None,
    decode_reduced: Annotated[bool | None, _opt("decode images longer than twice the detector's input side reduced; "
                                                "boxes stay in original pixels " + _default("decode_reduced"), "Limits")] = None,
    max_text_chars: Annotated[int | None, _opt("longest question / expression / caption in characters " + _default("max_text_chars"), "Limits")] = None,
    max_text_tokens: Annotated[int | None, _opt("longest text row in word pieces, at most the checkpoint's text positions "
                                                                 + _default("max_text_tokens"), "Limits")] = None,
    max_top_k: Annotated[int | None, _opt("largest top_k a request may ask for " + _default("max_top_k"), "Limits")] = None,
    max_candidates: Annotated[int | None, _opt("most image_ids / texts one /retrieve request may rank " + _default("max_candidates"), "Limits")] = None,
    api_keys: Annotated[str | None, _opt("comma-separated API keys for X-API-Key; none = open (prefer the env variable: "
                                         "command lines are visible to other users)", "Access")] = None,
    forwarded_allow_ips: Annotated[str | None, _opt("proxies trusted for X-Forwarded-For/-Proto: comma-separated IPs or "
                                                    "networks, or *; none = the headers are ignored", "Access")] = None,
    host: Annotated[str | None, _opt("bind address " + _default("host"), "Server")] = None,
    port: Annotated[int | None, _opt("bind port; 0 = any free port " + _default("port"), "Server")] = None,
    shutdown_drain_s: Annotated[float | None, _opt("on SIGTERM, how long /readyz answers 503 while requests are still "
                                                   "served, before the listener closes, s " + _default("shutdown_drain_s"), "Server")] = None,
    shutdown_timeout_s: Annotated[float | None, _opt("after the drain, how long in-flight requests may finish, s " + _default("shutdown_timeout_s"),
                                                     "Server")] = None,
    log_level: Annotated[str | None, _opt("log level: critical, error, warning, info, debug or trace "
                                          + _default("log_level"), "Server")] = None,
    log_format: Annotated[str | None, _opt("log lines: text (time, level, logger, message) or json (one object a "
                                           "line) " + _default("log_format"), "Server")] = None,
) -> None:
    """Run the HTTP service: POST /vqa /refer /retrieve /nlvr2 /images, GET /healthz /readyz /metrics, docs at /docs.

    Every option overrides the environment variable VLSERVE_<OPTION> (--max-wait-ms is VLSERVE_MAX_WAIT_MS).

    Exit code 2 when the settings or the models are not usable (one message says why). The port answers while the
    models load (/healthz 200, /readyz 503); a model set of the zoo that must be built first is built before that.

    SIGTERM or Ctrl-C: /readyz answers 503 while requests are still served, each answer closing its connection
    (--shutdown-drain-s; a second signal ends it), then stop accepting connections, let in-flight requests finish
    (--shutdown-timeout-s), drain the batchers, close Redis.
    """
    overrides = {name: value for name, value in locals().items()
                 if value is not None and name not in ("profile", "ctx")}
    from pydantic import ValidationError

    from service.settings import load_settings, settings_error_message, unknown_variables

    for warning in unknown_variables(os.environ):
        typer.echo(f"warning: {warning}", err=True)
    try:
        settings = load_settings(**overrides)
        if settings.model_dir is None and settings.detector_dir is None:
            settings = load_settings(**overrides, **zoo_model_dirs(profile or "demo"))
        elif profile is not None:
            typer.echo("error: --profile (VLSERVE_PROFILE) serves a model set of the zoo; give it or --model-dir and "
                       "--detector-dir (VLSERVE_MODEL_DIR, VLSERVE_DETECTOR_DIR), not both", err=True)
            raise typer.Exit(2)
    except ValidationError as exc:
        typer.echo(f"error: {settings_error_message(exc)}", err=True)
        raise typer.Exit(2) from None
    if quiet_log(ctx, settings.log_level):  # `vlserve -q serve`: at most warnings, whatever the level
        settings = settings.model_copy(update={"log_level": "warning"})
    raise typer.Exit(run_server(settings))


def quiet_log(ctx: typer.Context, level: str) -> bool:
    """Whether `vlserve --quiet` was given and `level` would log more than warnings."""
    from service.settings import LOG_LEVELS

    return bool(ctx.find_root().params.get("quiet")) and LOG_LEVELS.index(level) > LOG_LEVELS.index("warning")


def zoo_model_dirs(profile: str = "demo") -> dict[str, Path]:
    """The embedded default: a profile's model set in the cache (the demo's unless asked), built first if absent
    (vlserve.commands.zoo.BUILD_MINUTES: how long that takes)."""
    from training.zoo import PROFILES, build_zoo, is_built, zoo_dir

    from .checks import check_cache_root, fail, os_error

    if profile not in PROFILES:
        typer.echo(f"error: unknown profile {profile!r} (--profile, VLSERVE_PROFILE); choose one of {', '.join(PROFILES)}", err=True)
        raise typer.Exit(2)
    path = zoo_dir(profile)
    try:
        built = is_built(path)
    except OSError:  # a cache root that cannot be entered: check_cache_root says so
        built = False
    if not built:  # a built set is served from a read-only cache too; building one needs a writable cache
        check_cache_root()
        typer.echo(f"no model given: building the {profile} model set into {path} (first run only; "
                   f"`vlserve zoo build --profile {profile}` does the same)", err=True)
        try:
            build_zoo(profile)
        except OSError as exc:  # the cache's disk full, say (the writability check passes on a full disk)
            fail(f"cannot build the {profile} model set into {path}: {os_error(exc)}")
    return {"model_dir": path / "encoder", "detector_dir": path / "detector"}


OPEN_FILES_CEILING = 1 << 20  # the soft limit asked for where the hard one is unlimited


def raise_open_files_limit() -> None:
    """Every connection is a file descriptor, and where they run out the event loop closes new connections without
    a word: the soft limit (often 1024) is raised to the hard one, as servers do, and said."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):  # a container that forbids it: the limit stays
            return
        logging.getLogger("vlserve.app").info("open files: soft limit raised from %d to %d", soft, wanted)


def run_server(settings, log_level: str | None = None) -> int:
    """Serve until SIGTERM / Ctrl-C (the port answers at once, the models load behind it); 0 after a clean
    shutdown, 2 when start-up or loading failed (message on stderr). log_level: settings.log_level's override."""
    import uvicorn

    from service.app import StartupError, create_app
    from service.http_protocol import bounded_head_protocol
    from service.logs import configure as configure_logs
    from service.logs import error_line
    from service.shutdown import DrainingServer

    level = log_level or settings.log_level
    logs = configure_logs(level, settings.log_format)  # before the app: its start-up lines are in the format too
    raise_open_files_limit()
    try:
        app = create_app(settings, load_in_background=True)
    except StartupError as exc:
        typer.echo(error_line(str(exc), settings.log_format), err=True)
        return 2
    server = DrainingServer(uvicorn.Config(
        quiet_startup_failure(app), host=settings.host, port=settings.port, lifespan="on",
        log_config=logs, log_level=level, access_log=False,
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
        proxy_headers=bool(settings.forwarded_allow_ips), forwarded_allow_ips=settings.forwarded_allow_ips or None,
        server_header=False,
        http=bounded_head_protocol(settings.max_head_bytes, settings.head_timeout_s, app.state.metrics.http_refused)),
        app.state, settings.shutdown_drain_s)
    try:
        server.run()
    except SystemExit:  # uvicorn exits 3 when start-up or binding the port fails
        pass
    code = 0
    if app.state.startup_error or not server.started:  # loading failed after the port opened, or binding it
        why = app.state.startup_error or "the service did not start (see the log above)"
        typer.echo(error_line(str(why), settings.log_format), err=True)
        code = 2
    if getattr(app.state, "inference_abandoned", False):  # stopped while the models were loading (DrainingServer.run)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # the interpreter would wait for the loading thread at exit
    return code


def quiet_startup_failure(app):
    """The app, with a known start-up failure reported as its one-line message instead of a traceback."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def sending(message):
            if message["type"] == "lifespan.startup.failed" and app.state.startup_error:
                message = {**message, "message": ""}  # run_server prints the reason once, after uvicorn exits
            await send(message)

        await app(scope, receive, sending)

    return wrapped
