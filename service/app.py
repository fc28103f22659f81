"""`create_app(settings)`: the FastAPI app. Models load in the lifespan (`vlserve serve`: in the background, the port
answering meanwhile, /readyz 503 and the task routes 503 not-ready); /readyz turns 200 after warm-up.

Start-up: detector and encoder checkpoint (refused when the checkpoint expects another detector) ->
feature store -> RegionService -> runtime -> one Batcher per served task -> warm-up -> ready.
Shutdown (SIGTERM, service/shutdown.py): a drain period (`shutdown_drain_s`) in which /readyz answers 503 while
requests are still served, each answer with `Connection: close` -> uvicorn stops accepting and lets in-flight
requests finish (`shutdown_timeout_s`; then the work still queued or running fails: 503) -> lifespan: not ready ->
batchers drained -> detector drained (both within what is left of the same `shutdown_timeout_s`) -> feature store
(Redis) closed -> runtime closed -> inference thread shut down (a batch it is still running is not waited for).
"""
from __future__ import annotations

import asyncio
import functools
import gc
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from models import ModelConfig
from models.attention import layer_kind
from models.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from models.query_bank import QueryBank
from models.detector import DetectorConfig, RegionDetector
from models.detector.io import load_detector
from models.detector.onnx import OnnxDetector
from models.repository import Repository, is_repository, load_repository

from .admission import ROUTES, TASK_KINDS, AdmissionMiddleware
from .batcher import Batcher, BatcherConfig, InFlight
from .errors import PROBLEM_JSON, InternalErrors, install_error_handlers, is_v2
from .explain import Explainer, grounding_report
from .feature_store import StoreConfigError, create_store, entry_bytes
from .logs import AccessLog
from .metrics import Metrics, MetricsMiddleware
from .query_bank import BankPriors
from .pipeline import ENDPOINT_OF, Limits, Pipeline, TaskSpec, batch_fn, fused_batch_fn, task_specs
from .regions import RegionService
from .routes import ROUTERS
from .routes.common import Services, problems
from .runtime import Runtime, create_runtime
from .schemas import ModelInfo, Problem
from .http_basics import HTTPBasics
from .security import JSON_TYPES, PUBLIC_PATHS, APIKeyMiddleware, BodyLimitMiddleware
from .settings import Settings
from .shutdown import CloseWhileDraining, InferenceExecutor
from .stream_cache import StreamCache

log = logging.getLogger("vlserve.app")

DEMO_SET = "`vlserve serve` then serves the demo model set, building it on first use"


def missing_models(settings: Settings) -> str:
    """Why there is no model to serve when the encoder or the detector directory (or both) is not set, in one line."""
    if settings.model_dir is not None:
        return (f"no detector given for the encoder {settings.model_dir}: set VLSERVE_DETECTOR_DIR (--detector-dir) "
                f"to the detector it was trained on, or give neither directory: {DEMO_SET}")
    if settings.detector_dir is not None:
        return (f"no encoder given for the detector {settings.detector_dir}: set VLSERVE_MODEL_DIR (--model-dir) to "
                f"a checkpoint trained on its regions, or give neither directory: {DEMO_SET}")
    return ("no model to serve: set VLSERVE_MODEL_DIR and VLSERVE_DETECTOR_DIR (--model-dir, --detector-dir), or run "
            "`vlserve serve` with neither: it serves the demo model set, building it on first use")


DESCRIPTION = """Vision-and-language inference: VQA, referring expressions, image-text retrieval and NLVR2.

Send images inline (`image`: base64) or register them once with `POST /images` and then refer to them by
`image_id` (sha256 of the bytes). Add `?timings=true` to any task request for per-stage timings (ms).
Errors are RFC 9457 problem details (`application/problem+json`). When API keys are configured every route
but /healthz and /readyz needs the header `X-API-Key`.
"""


class StartupError(RuntimeError):
    """The service cannot start with these settings; the message says why in one line."""


@dataclass
class Loaded:
    detector: RegionDetector | OnnxDetector  # OnnxDetector: the detector graph of a repository exported with it
    fingerprint: str
    checkpoint: Checkpoint | Repository  # a checkpoint directory (torch) or an exported model repository


def load_encoder(settings: Settings) -> Checkpoint | Repository:
    """The torch runtime serves a checkpoint directory, the others a model repository made by `vlserve export`."""
    exported = is_repository(settings.model_dir)
    if settings.runtime == "torch" and exported:
        raise StartupError(f"{settings.model_dir} is an exported model repository: serve it with "
                           f"VLSERVE_RUNTIME=onnxruntime, or serve its checkpoint directory with the torch runtime")
    if settings.runtime != "torch" and not exported:
        raise StartupError(f"runtime {settings.runtime!r} serves a model repository but {settings.model_dir} is not one; "
                           f"make it with `vlserve export {settings.model_dir} --out REPO_DIR` and serve REPO_DIR")
    return load_repository(settings.model_dir) if exported else load_checkpoint(settings.model_dir)


def model_config(model: Checkpoint | Repository) -> ModelConfig:
    return model.config if isinstance(model, Repository) else model.model.config


def region_tag_table(tokenizer, classes: list[str], encoder) -> np.ndarray | None:
    """Detector class id -> the word ids an encoder that reads region tags is given: the first sub-word of the
    class name (C,), or every sub-word (C, K) for u-visualbert's published embeddings; None for other encoders."""
    if not encoder.region_tags:
        return None
    return tokenizer.tag_table(classes, encoder.embedding_style)


def load_models(settings: Settings) -> Loaded:
    """Detector and encoder checkpoint, checked against each other."""
    from .runtime.torch_runtime import device_unavailable

    if why := device_unavailable(settings.device):  # before any weights move there
        raise StartupError(why)
    try:
        detector, fingerprint = load_detector(settings.detector_dir, device=settings.device)
        checkpoint = load_encoder(settings)
    except (CheckpointError, FileNotFoundError) as exc:
        raise StartupError(str(exc)) from None
    expected = (checkpoint.manifest.get("detector") or {}).get("fingerprint")
    if expected and expected != fingerprint:
        raise StartupError(
            f"{settings.model_dir} was trained on region features of detector {expected}, but {settings.detector_dir} "
            f"is detector {fingerprint}; serve the checkpoint with the detector it expects")
    want, have = model_config(checkpoint).encoder.visual_feat_dim, detector.config.feature_dim
    if want != have:
        raise StartupError(f"{settings.model_dir} reads {want}-d region features but the detector gives {have}-d")
    if isinstance(checkpoint, Repository) and checkpoint.detector_path is not None:
        from .runtime.onnx_runtime import exported_detector  # the repository's detector graph replaces torch's

        detector = exported_detector(checkpoint, detector.config, settings)
        bf16_detector = False
    else:
        served = detector_for_serving(detector, settings, fingerprint)
        bf16_detector, fingerprint = served != fingerprint, served
    if settings.precision == "bf16" and settings.runtime != "torch" and not bf16_detector:
        log.warning("precision bf16 changes nothing here: the %s runtime runs the exported graphs in the precision "
                    "they were exported in, and this detector has no bfloat16 path", settings.runtime)
    return Loaded(detector, fingerprint, checkpoint)


def detector_for_serving(detector: RegionDetector, settings: Settings, fingerprint: str) -> str:
    """A butd detector rewritten into its serving form (models/detector/butd.py: batch norms folded, channels-last,
    RoIPool as a gather, res5 in bfloat16 where `precision` resolves to bf16, its region choice settled in float32
    unless `detector_settle` is off). Returns the feature-store namespace: the fingerprint, with "-bf16s" when the
    features carry bfloat16's rounding and the regions are float32's, "-bf16" when the regions are bfloat16's too,
    so that pods serving differently never share cached regions."""
    import torch

    from .runtime.torch_runtime import resolve_precision

    try:
        precision = resolve_precision(settings.precision, torch.device(settings.device))
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if not detector.for_serving(dtype, settle=settings.detector_settle) or precision != "bf16":
        return fingerprint
    return f"{fingerprint}-bf16s" if detector.settles_regions else f"{fingerprint}-bf16"


def check_cache_bound(settings: Settings, detector: DetectorConfig) -> None:
    """StartupError when the in-process feature store could not hold one image's regions at the detector's largest
    (every image would then be dropped as soon as it is computed: registered, and unknown at once)."""
    need = entry_bytes(detector.feature_dim, detector.max_regions, detector.image_feature)
    if 0 < settings.cache_max_bytes < need:
        raise StartupError(
            f"VLSERVE_CACHE_MAX_BYTES {settings.cache_max_bytes} cannot hold one image's regions: this detector's "
            f"{detector.max_regions} regions of {detector.feature_dim} features take {need} bytes; set at least "
            f"{need}" + (" (or 0 for no in-process tier in front of Redis)" if settings.redis_url else ""))


def text_token_limit(settings: Settings, checkpoint: Checkpoint | Repository) -> int:
    """max_text_tokens, or the checkpoint's text positions where they are fewer (a longer row would index past its
    position table): the limit a text's 422 then names."""
    positions = model_config(checkpoint).encoder.text_positions
    if settings.max_text_tokens <= positions:
        return settings.max_text_tokens
    log.warning("max_text_tokens %d is more than %s can place; texts are limited to its %d word pieces",
                settings.max_text_tokens, settings.model_dir, positions)
    return positions


def detector_batch_size(settings: Settings, detector) -> int:
    """detector_max_batch_size, or 1 for a detector that batching does not speed up (batch_gain: the butd family on
    a CPU, an exported graph): each new image then gets its regions as soon as they are computed, and the encoder's
    batches, which share the one inference thread, wait for one image at most, not for a whole batch of them."""
    return settings.detector_max_batch_size if detector.batch_gain else 1


def model_info(loaded: Loaded, runtime_name: str, precision: str = "fp32") -> ModelInfo:
    enc = model_config(loaded.checkpoint).encoder
    manifest = loaded.checkpoint.manifest
    weights = (manifest.get("files") or {}).get("model.safetensors") or (manifest.get("source") or {}).get("weights_sha256", "")
    return ModelInfo(preset=enc.preset, size=enc.size, checkpoint=weights[:12], detector=loaded.fingerprint,
                     runtime=runtime_name, precision=precision)


def stream_cache(settings: Settings, runtime, specs: dict[str, TaskSpec], model: ModelInfo) -> StreamCache | None:
    """The two-stream retrieval cache, when the runtime runs the itm head on split streams and the cache is on."""
    itm = specs.get("itm")
    if itm is None or settings.stream_cache_max_bytes == 0 or not runtime.splits_streams(itm.task):
        return None
    return StreamCache(settings.stream_cache_max_bytes, model=model.checkpoint, detector=model.detector)


def bank_priors(checkpoint: Checkpoint | Repository, settings: Settings) -> BankPriors | None:
    """The query-bank priors of a model with a bank (labels.json), None without one."""
    try:
        bank = QueryBank.from_labels(checkpoint.labels)
    except ValueError as exc:
        raise StartupError(f"{settings.model_dir}: labels.json: {exc}") from None
    if not bank:
        return None
    positions = model_config(checkpoint).encoder.text_positions
    return BankPriors(bank, checkpoint.tokenizer, settings.query_bank_max_images, max_length=positions)


def explainer(loaded: Loaded, runtime, inference: ThreadPoolExecutor) -> Explainer | None:
    """What answers explain=true, where the runtime returns attention (torch, serving a checkpoint directory)."""
    if type(runtime).explain is Runtime.explain or not isinstance(loaded.checkpoint, Checkpoint):
        return None
    return Explainer(runtime, inference, loaded.checkpoint.tokenizer, layer_kind(loaded.checkpoint.model),
                     grounding_report(loaded.checkpoint))


def warm_up(loaded: Loaded, pipeline: Pipeline, runtime) -> float:
    """The detector on a small image, then one example per served task through the runtime; returns the detector's
    time (s), the batch time its admission goes by until a batch is measured (the image is resized to the
    detector's input like any photo: about a photo's time)."""
    image = np.full((64, 64, 3), 128, np.uint8)
    image[16:48, 16:48] = (200, 40, 40)
    t0 = time.perf_counter()
    (rf,) = loaded.detector.extract([image])
    detector_s = time.perf_counter() - t0
    pipeline.warm_up(runtime, rf.to_float16())
    return detector_s


async def stop_batchers(batchers: list[Batcher | RegionService], state: Any, timeout_s: float) -> None:
    """Stop the batchers in order (the task batchers, then the detector), each finishing its queued work, all within
    one budget: until state.shutdown_deadline (set on SIGTERM by service.shutdown.DrainingServer: shutdown_timeout_s
    after the listener closed, shared with the in-flight requests), else timeout_s from now. Work left when it runs
    out fails at once (BatcherClosedError)."""
    deadline = getattr(state, "shutdown_deadline", None) or time.monotonic() + timeout_s
    for batcher in batchers:
        await batcher.stop(max(deadline - time.monotonic(), 0.0))


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    metrics: Metrics = app.state.metrics
    async with AsyncExitStack() as stack:
        # One thread runs every model call (load, warm-up, detector, encoder): torch's OpenMP pool belongs to the
        # thread that calls it, and a second calling thread brings a second pool that competes for the same cores.
        # Measured on 2 cores: once two threads had called the demo encoder, every call took 1.55x as long.
        inference = InferenceExecutor(thread_name_prefix="vlserve-inference")

        def stop_inference() -> None:
            inference.shutdown(wait=False, cancel_futures=True)
            if inference.busy:  # a batch cut short by the shutdown timeout: nothing can interrupt it
                log.warning("shutdown: a batch is still running on the inference thread; the process exits "
                            "without waiting for it")
                app.state.inference_abandoned = True  # service.shutdown.DrainingServer.run ends the process

        stack.callback(stop_inference)
        loading = asyncio.create_task(load(app, stack, inference), name="vlserve-load")
        if app.state.load_in_background:  # `vlserve serve`: /healthz answers, and /readyz 503, while it loads
            loading.add_done_callback(functools.partial(loading_failed, app))
        else:
            await loading
        try:
            yield
        finally:
            app.state.ready = False  # new requests get 503 while the batchers drain
            metrics.ready.set(0)
            if not loading.done():  # stopped while loading: what has been loaded is closed by the stack
                loading.cancel()
                await asyncio.gather(loading, return_exceptions=True)
    app.state.services = None


def loading_failed(app: FastAPI, loading: asyncio.Task) -> None:
    """The end of a load in the background: a failure ends the process (service.shutdown.DrainingServer stops on
    state.startup_error, `vlserve serve` prints it and exits 2), an unexpected one with its traceback logged."""
    if loading.cancelled() or loading.exception() is None:
        return
    if not app.state.startup_error:
        exc = loading.exception()
        log.error("start-up failed", exc_info=exc)
        app.state.startup_error = f"start-up failed ({type(exc).__name__}: {exc}); the log above has the details"


async def load(app: FastAPI, stack: AsyncExitStack, inference: InferenceExecutor) -> None:
    """Everything the routes need, loaded and warmed up on the inference thread, then `state.ready`; what must be
    closed at shutdown goes on `stack`. StartupError (its message in state.startup_error, which `vlserve serve`
    prints as one line) when it cannot serve."""
    try:
        await load_services(app, stack, inference)
    except StartupError as exc:
        app.state.startup_error = str(exc)
        raise


async def load_services(app: FastAPI, stack: AsyncExitStack, inference: InferenceExecutor) -> None:
    settings: Settings = app.state.settings
    metrics: Metrics = app.state.metrics
    loop = asyncio.get_running_loop()
    try:
        loaded = await loop.run_in_executor(inference, load_models, settings)
        runtime = await loop.run_in_executor(inference, create_runtime, settings, loaded.checkpoint)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    stack.callback(runtime.close)
    check_cache_bound(settings, loaded.detector.config)
    store = create_store(settings, loaded.fingerprint, loaded.detector.config.feature_dim)
    stack.push_async_callback(store.close)
    try:
        await store.check()  # a Redis refusing this client for good stops start-up; an unreachable one warns
    except StoreConfigError as exc:
        raise StartupError(str(exc)) from None

    regions = RegionService(
        loaded.detector, loaded.fingerprint, store,
        BatcherConfig(detector_batch_size(settings, loaded.detector), settings.detector_max_wait_ms,
                      settings.max_queue, settings.detector_max_queue_wait_s * 1000),
        settings.max_pixels, inference, on_batch=metrics.on_batch("detector"),
        max_pixels_in_flight=settings.decode_max_pixels_in_flight, reduced_decoding=settings.decode_reduced)
    config = model_config(loaded.checkpoint)
    specs = task_specs(runtime.tasks, config.heads, loaded.checkpoint.labels)
    if not specs:  # ready, it would answer 404 to every task route
        heads = ", ".join(f"{task} ({kind})" for task, kind in runtime.tasks.items()) or "none"
        reads = ", ".join(f"{endpoint} reads a {kind} head" for kind, endpoint in ENDPOINT_OF.items())
        raise StartupError(f"{settings.model_dir or 'the model'} has no head an endpoint serves (its heads: {heads}); "
                           f"{reads}")
    model = model_info(loaded, runtime.name, runtime.precision)
    streams = stream_cache(settings, runtime, specs, model)
    encoder_batching = BatcherConfig(settings.max_batch_size, settings.max_wait_ms, settings.max_queue,
                                     settings.max_queue_wait_ms)
    encoder_busy = InFlight()  # the task batchers share one runtime: a batch goes at once only when it is idle

    def encoder_batcher(spec: TaskSpec) -> Batcher:
        split = streams is not None and spec.kind == "itm"
        fn = fused_batch_fn(runtime, spec.task, streams) if split else batch_fn(runtime, spec.task)
        return Batcher(spec.task, fn, encoder_batching, inference, on_batch=metrics.on_batch(spec.task),
                       in_flight=encoder_busy)

    batchers = {spec.task: encoder_batcher(spec) for spec in specs.values()}
    limits = Limits(settings.max_text_chars, text_token_limit(settings, loaded.checkpoint), settings.max_top_k,
                    settings.max_candidates)
    tokenizer = loaded.checkpoint.tokenizer
    tags = region_tag_table(tokenizer, loaded.detector.config.classes, model_config(loaded.checkpoint).encoder)
    pipeline = Pipeline(regions, tokenizer, specs, batchers, limits, streams, tag_words=tags,
                        bank=bank_priors(loaded.checkpoint, settings) if "itm" in specs else None,
                        bank_on_register=settings.query_bank_on_register,
                        explainer=explainer(loaded, runtime, inference),
                        detector_labels=(loaded.detector.config.classes, loaded.detector.config.attributes))
    metrics.watch({**batchers, "detector": regions}, store, regions, streams)

    await regions.start()
    for batcher in batchers.values():
        await batcher.start()
    stack.push_async_callback(stop_batchers, [*reversed(batchers.values()), regions], app.state,
                              settings.shutdown_timeout_s)

    def out_of_time() -> int:  # shutdown_timeout_s has run out (service/shutdown.py): fail their work now
        return sum(batcher.close_now() for batcher in (*batchers.values(), regions))

    app.state.out_of_time = out_of_time
    stack.callback(setattr, app.state, "out_of_time", None)
    if pipeline.bank is not None:  # before the batchers stop: scheduled priors are cancelled, not left waiting
        stack.push_async_callback(pipeline.bank.close)
    detector_s = await loop.run_in_executor(inference, warm_up, loaded, pipeline, runtime)
    regions.expect(detector_s)  # admits a burst of new images that comes before a detector batch is measured
    if settings.detector_max_queue_wait_s:
        log.info("detector: %.2f s for an image at warm-up; a new image is refused (429) while more than %g s of "
                 "detector work is queued ahead of it", detector_s, settings.detector_max_queue_wait_s)

    # Start-up leaves ~400k long-lived objects (modules, tensors, tokenizer). A full garbage collection scans
    # them all (170 ms with the demo model) while every request waits: at 32 clients it set the p99 latency
    # (about 260 ms against a p50 of 75). Frozen, collections skip them.
    gc.collect()
    gc.freeze()
    stack.callback(gc.unfreeze)
    app.state.services = Services(pipeline=pipeline, model=model)
    app.state.ready = True
    metrics.ready.set(1)
    log.info("ready: %s serving %s", app.state.services.model.preset, ", ".join(specs) or "nothing")


def package_version() -> str:
    try:
        return importlib.metadata.version("vlserve")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


# The problem types any route may answer whatever its declarations: a wrong method (405); the body's checks
# (security.py): a Content-Length that is not a number (400), a body that stops arriving (408), too large (413),
# compressed or of a type the route does not read (415); and the HTTP protocol's, before any middleware
# (http_protocol.py): a request it cannot parse (400), a head that does not arrive in time (408) or is too large (431)
MIDDLEWARE_PROBLEMS = ("bad-request", "method-not-allowed", "request-timeout", "body-too-large", "unsupported-media-type",
                       "head-too-large", "queue-full", "not-implemented")
# what a route reads its body as (security.BodyLimitMiddleware: another Content-Type is a 415); the v2 routes read
# their JSON header by Inference-Header-Content-Length whatever the type
BODY_TYPES: dict[str, tuple[str, ...]] = {path: JSON_TYPES for path in TASK_KINDS if not is_v2(path)}
BODY_TYPES["/images"] = (*JSON_TYPES, "multipart/form-data")
_BOUND_KEYWORD = {"integer": "maximum", "number": "maximum", "string": "maxLength", "array": "maxItems"}


def bound_by_settings(node: Any, settings: Settings) -> None:
    """Give every schema that names the setting bounding it (`x-setting`, service/schemas.py) that bound."""
    if isinstance(node, dict):
        if "x-setting" in node:
            node[_BOUND_KEYWORD[node["type"]]] = getattr(settings, node["x-setting"])
        for value in node.values():
            bound_by_settings(value, settings)
    elif isinstance(node, list):
        for value in node:
            bound_by_settings(value, settings)


def _as_written(response: dict[str, Any]) -> dict[str, Any]:
    """A `problems()` entry as FastAPI writes it into the schema: the model's $ref beside the narrowing."""
    written = {key: value for key, value in response.items() if key != "model"}
    schema = written["content"]["application/json"]["schema"]
    written["content"] = {"application/json": {"schema": {**schema, "$ref": f"#/components/schemas/{Problem.__name__}"}}}
    return written


def custom_openapi(app: FastAPI, api_keys: bool):
    """The generated schema, completed with what the routes' declarations do not say: the answers the middleware
    gives on every route (400, 413, and 401 where keys are configured), error answers as application/problem+json
    (the Problem schema narrowed to the types each route may answer at each status), the bounds that come from
    settings, and the API-key scheme."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        bound_by_settings(schema, app.state.settings)
        for path, operations in schema.get("paths", {}).items():
            middleware = MIDDLEWARE_PROBLEMS + (("unauthorized",) if api_keys and path not in PUBLIC_PATHS else ())
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                for status, response in problems(*middleware).items():
                    responses.setdefault(str(status), _as_written(response))
                operation["responses"] = dict(sorted(responses.items()))
                for status, response in responses.items():
                    content = response.get("content", {})
                    if status[:1] in "45" and "application/json" in content:
                        problem = content.pop("application/json")
                        narrowed = problem["schema"]
                        if "$ref" in narrowed and len(narrowed) > 1:  # allOf: not every tool reads $ref siblings
                            problem["schema"] = {"allOf": [{"$ref": narrowed.pop("$ref")}, narrowed]}
                        content[PROBLEM_JSON] = problem
                if api_keys and path not in PUBLIC_PATHS:
                    operation["security"] = [{"APIKey": []}]
        # the service's URL is where this schema was fetched from (OpenAPI 3.1 4.8.5: a relative server URL is
        # relative to the document): without it, "/" is meant, and behind a proxy's path prefix (/vlserve/) the
        # requests /docs' "Try it out" and generated clients send would miss the prefix
        schema["servers"] = [{"url": ".", "description": "where this schema is served"}]
        if api_keys:
            schema.setdefault("components", {})["securitySchemes"] = {
                "APIKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}}
        app.openapi_schema = schema
        return schema

    return openapi


def create_app(settings: Settings, load_in_background: bool = False) -> FastAPI:
    """The service for `settings`; nothing loads until the lifespan starts (uvicorn, or `with TestClient(app)`), which
    returns once the models are loaded and warm, or at once with `load_in_background` (`vlserve serve`: the port
    answers while they load, /readyz 503 and the task routes 503 not-ready until then)."""
    if settings.model_dir is None or settings.detector_dir is None:
        raise StartupError(missing_models(settings))
    # redirect_slashes off: "/vqa/" is a 404 problem, not a bare 307 to an http:// URL built from the Host header
    app = FastAPI(title="vlserve", version=package_version(), description=DESCRIPTION, lifespan=lifespan,
                  redirect_slashes=False, docs_url=None, redoc_url=None)  # /docs: routes/docs.py (no CDN)
    app.state.settings = settings
    app.state.metrics = metrics = Metrics()
    metrics.expect_refusals(sorted(set(ROUTES.values()) | {"/images"}))  # /images: the detector's queue refuses too
    app.state.services = None
    app.state.ready = False
    app.state.draining = False  # set on SIGTERM by service.shutdown.DrainingServer: /readyz 503, requests still served
    app.state.startup_error = None
    app.state.load_in_background = load_in_background
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    # outermost last: metrics see every answer, keys are checked before the body is read
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                       body_types=BODY_TYPES, endpoints={**{path: path for path in BODY_TYPES}, **ROUTES},
                       max_bytes_in_flight=settings.max_body_bytes_in_flight, max_s=settings.body_max_s)
    app.add_middleware(AdmissionMiddleware, state=app.state)  # after the key check, before the body is read
    app.add_middleware(APIKeyMiddleware, keys=settings.api_keys)
    app.add_middleware(CloseWhileDraining, state=app.state)
    app.add_middleware(HTTPBasics)  # HEAD as GET; X-Request-ID on every answer
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outside CloseWhileDraining: counts its 503s as 503s
    app.add_middleware(InternalErrors)  # a failure anything inside raised: logged once with its id, a 500 problem
    app.add_middleware(AccessLog)  # a line for every answer, the 500s above included
    app.openapi = custom_openapi(app, bool(settings.api_keys))
    return app
