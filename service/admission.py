"""Admission before the request is read: a task request its encoder batcher would refuse gets 429 at once.

Under overload most requests are refused, and each refusal costs the event loop that the admitted requests also
need. Refusing here, before the body is read, parsed, validated and tokenized and before its image is looked up,
makes a refusal a header check: the encoder keeps its full rate for the requests it took and their latency stays
bounded (docs/RELIABILITY.md, Overload). The batcher decides (Batcher.admit: a full queue, or batches queued ahead
longer than max_queue_wait_ms); it asks again when the request is submitted, since the body and the image take time.
"""
from __future__ import annotations

from starlette.datastructures import State
from starlette.types import ASGIApp, Receive, Scope, Send

from .batcher import QueueFullError
from .metrics import ENDPOINT
from .errors import queue_full, send_problem
from .routes.v2 import MODELS, VERSION

TASK_KINDS = {"/vqa": "vqa", "/refer": "refer", "/retrieve": "itm", "/nlvr2": "nlvr2"}  # path -> head kind
ROUTES = {path: path for path in TASK_KINDS}  # path -> the route template its answers are counted under (metrics)
for name, model in MODELS.items():  # the same, KServe v2
    for version, template in (("", "/v2/models/{name}/infer"), (f"/versions/{VERSION}", "/v2/models/{name}/versions/{version}/infer")):
        TASK_KINDS[f"/v2/models/{name}{version}/infer"] = model.kind
        ROUTES[f"/v2/models/{name}{version}/infer"] = template


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, state: State):
        self.app = app
        self.state = state  # the app's state: `services` once the lifespan has loaded them

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = TASK_KINDS.get(scope.get("path", "")) if scope["type"] == "http" and scope.get("method") == "POST" else None
        services = getattr(self.state, "services", None) if kind else None
        spec = services.pipeline.specs.get(kind) if services is not None else None
        if spec is not None:  # no head, not loaded: the route answers (404, 503)
            try:
                services.pipeline.batchers[spec.task].admit()
            except QueueFullError as exc:
                scope[ENDPOINT] = ROUTES[scope["path"]]  # refused before routing: counted under its route all the same
                return await refuse(scope, send, exc)
        await self.app(scope, receive, send)


async def refuse(scope: Scope, send: Send, exc: QueueFullError) -> None:
    """The 429 problem+json answer errors.py gives a QueueFullError, sent straight from here."""
    detail, headers = queue_full(exc)
    await send_problem(scope, send, 429, detail, "queue-full", "Too many requests", headers)
