"""Optional API keys (X-API-Key) and the request body's checks, as pure ASGI middleware.

Both answer before the route runs: an unauthenticated client cannot make the service buffer a large body; a large
body is refused at its Content-Length or as soon as the streamed bytes pass the limit; a body the route could not
read (a compressed one, or one whose Content-Type is not what the route reads) is refused before it is read; a body
that stops arriving is answered 408 instead of holding its connection and its request open for ever.

A client that goes away is not served: when the connection closes while the body arrives, the route never runs; when
it closes after, while the route works, the route is cancelled, and with it the work it queued (a cancelled request's
items leave the batchers' queues; work another request shares goes on for that one: service/shared_work.py). Either
request is counted as 499, with no answer sent (metrics.CLIENT_CLOSED).
"""
from __future__ import annotations

import asyncio
import hmac
import math
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import send_problem, shown
from .metrics import ENDPOINT, client_closed

# probes: they carry no data and cannot always send headers (the v2 ones: the Open Inference Protocol's);
# /metrics: counts and timings, no request data, and Prometheus' pod discovery scrapes it without headers (behind a
# key it would scrape nothing and the queue-depth autoscaler would go blind); and the page to try it (routes/page.py): static files that hold no data; the requests it sends carry the key its
# user types in
PAGE_PATHS = frozenset({"/", "/page/app.js", "/page/style.css", "/page/sample-shapes.png", "/page/sample-shapes-2.png",
                        "/page/sample-photo.jpg"})
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready", "/metrics"}) | PAGE_PATHS


class APIKeyMiddleware:
    """401 unless X-API-Key equals one of the keys (constant-time against every key). No keys = open service."""

    def __init__(self, app: ASGIApp, keys: Iterable[str]):
        self.app = app
        self.keys = [k.encode() for k in keys if k]

    def allowed(self, sent: bytes) -> bool:
        ok = False
        for key in self.keys:  # no early exit: the time taken does not depend on which key matched
            ok |= hmac.compare_digest(sent, key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        sent = dict(scope["headers"]).get(b"x-api-key")
        if sent is None:
            return await send_problem(scope, send, 401, "this service needs an API key in the X-API-Key header",
                                      headers={"WWW-Authenticate": "ApiKey"})
        if not self.allowed(sent):
            return await send_problem(scope, send, 401, "the X-API-Key is not valid",
                                      headers={"WWW-Authenticate": "ApiKey"})
        await self.app(scope, receive, send)


JSON_TYPES = ("application/json",)  # and any application/*+json


def media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def readable(allowed: tuple[str, ...] | None, content_type: str | None) -> bool:
    """Whether a route that reads the `allowed` media types (None: any) reads a body of this Content-Type (None: not
    sent, read as JSON as FastAPI reads it)."""
    if allowed is None or content_type is None:
        return True
    kind = media_type(content_type)
    return kind in allowed or (JSON_TYPES[0] in allowed and kind.startswith("application/") and kind.endswith("+json"))


class BodyLimitMiddleware:
    """The request body's checks: 413 for bodies over max_bytes (by Content-Length up front, else by counting the
    streamed chunks); 415 for a compressed body (Content-Encoding) and for a Content-Type the route does not read
    (`body_types`);
    408 when no byte of the body arrives for timeout_s (a client that stalls or trickles nothing would hold the
    request, its connection and its buffered bytes open for ever; a slow client that keeps sending is served) or the
    whole body has not arrived max_s after the request began; 429 when the bodies held by all requests, from their
    first byte to their answer, would pass max_bytes_in_flight (40 bodies of 9 MiB trickled in held 250 MB; with the
    bound, max_s keeps a few slow clients from holding it, and every upload refused, for longer than that).

    The body is read here (at most max_bytes of it) and replayed to the app, so the app never sees a
    partial body and the 413 is always a complete problem+json answer. A body cut short by the client's going away
    ends the request there; after the body, the connection is watched, and the route cancelled if the client goes
    away before its answer (module doc).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, body_types: dict[str, tuple[str, ...]],
                 endpoints: dict[str, str] | None = None, max_bytes_in_flight: int = 0, max_s: float = math.inf):
        self.app = app
        self.endpoints = endpoints or {}  # path -> the route template a request cut short is counted under
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.body_types = body_types  # path -> the media types its route reads; paths not named read any
        self.max_s = max_s  # the whole body's time, from the request's start
        self.max_bytes_in_flight = max_bytes_in_flight  # 0 = unbounded
        self.bytes_in_flight = 0  # of the bodies requests hold now

    def too_large(self) -> str:
        return f"request body is over the limit of {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = scope

        async def refuse(status: int, detail: str, headers: dict[str, str] | None = None) -> None:
            given.setdefault(ENDPOINT, self.endpoints.get(scope["path"]))  # not routed: counted under its route
            await send_problem(scope, send, status, detail, headers=headers)

        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await refuse(400, "Content-Length is not a number")
            if declared > self.max_bytes:
                return await refuse(413, self.too_large())
        coding = headers.get(b"content-encoding", b"").decode("latin-1").strip().lower()
        if coding not in ("", "identity"):
            return await refuse(415, f"Content-Encoding {shown(coding)} is not supported: send the body uncompressed",
                                headers={"Accept-Encoding": "identity"})
        content_type = headers.get(b"content-type")
        content_type = content_type.decode("latin-1") if content_type is not None else None
        allowed = self.body_types.get(scope.get("path", ""))
        if not readable(allowed, content_type):
            wanted = " or ".join(allowed)
            return await refuse(415, f"this route reads a body of type {wanted}, not {shown(media_type(content_type))}; "
                                "send JSON with Content-Type: application/json")
        if allowed is not None and content_type is None:  # read as JSON: say so to the route's parser
            scope = {**scope, "headers": [*scope["headers"], (b"content-type", JSON_TYPES[0].encode())]}
        chunks, total, held = [], 0, 0
        loop = asyncio.get_running_loop()
        try:
            try:
                last = loop.time() + self.max_s  # the whole body's deadline
                async with asyncio.timeout(None) as deadline:  # one timer for the whole body, moved on at each chunk
                    while True:
                        deadline.reschedule(min(loop.time() + self.timeout_s, last))
                        message = await receive()
                        if message["type"] != "http.request":  # the client went away: what came is no request
                            given.setdefault(ENDPOINT, self.endpoints.get(given["path"]))  # not routed
                            return client_closed(scope)
                        size = len(message.get("body", b""))
                        total += size
                        if total > self.max_bytes:
                            break
                        if 0 < self.max_bytes_in_flight < self.bytes_in_flight + size:
                            return await refuse(429, "the service holds as many bytes of request bodies as it may at "
                                                     "once (max_body_bytes_in_flight); retry in 1 s",
                                                headers={"Retry-After": "1"})
                        self.bytes_in_flight += size
                        held += size
                        chunks.append(message)
                        if not message.get("more_body", False):
                            break
            except TimeoutError:
                why = (f"the request body was not complete within {self.max_s:g} s (body_max_s)"
                       if loop.time() >= last else
                       f"no byte of the request body arrived for {self.timeout_s:g} s (body_timeout_s)")
                return await refuse(408, why, headers={"Connection": "close"})
            if total > self.max_bytes:
                return await refuse(413, self.too_large())
            body = b"".join(m.get("body", b"") for m in chunks)
            chunks.clear()
            try:
                await serve_while_connected(self.app, scope, body, receive, send)
            finally:
                if scope is not given and "route" in scope:  # the route the router matched, for the metrics' label
                    given["route"] = scope["route"]
        finally:
            self.bytes_in_flight -= held  # the body is the request's until its answer


WATCH_AFTER_S = 0.02  # a request answered sooner is not watched: its work is done before a disconnect could stop it


async def serve_while_connected(app: ASGIApp, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
    """Run the app on the request whose whole `body` has been read from `receive`, which this watches from
    WATCH_AFTER_S on: when the client goes away before the answer is complete, the app is cancelled where it waits
    (its task: uvicorn runs each request in one) and the request ends without an answer, counted as
    metrics.CLIENT_CLOSED. The app's receive replays the body, then tells it of the disconnect."""
    task = asyncio.current_task()
    replay: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    gone = asyncio.Event()  # the client went away, or the answer is complete (what receive tells after it)
    answered = cancelled = False

    async def replayed() -> Message:
        if replay:
            return replay.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def sending(message: Message) -> None:
        nonlocal answered
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            answered = True
        await send(message)

    async def watch() -> None:
        nonlocal cancelled
        while (await receive())["type"] != "http.disconnect":  # nothing else comes after the body
            pass
        gone.set()
        if not answered:
            cancelled = True
            task.cancel()

    # watched from WATCH_AFTER_S on: most answers come before, and a task for each of them cost throughput
    watching: list[asyncio.Task] = []
    start = asyncio.get_running_loop().call_later(
        WATCH_AFTER_S, lambda: watching.append(asyncio.create_task(watch(), name="vlserve-client-watch")))
    try:
        await app(scope, replayed, sending)
    except asyncio.CancelledError:
        if not cancelled or task.uncancel() > 0:  # cancelled by someone else too (the server's shutdown)
            raise
        client_closed(scope)
    else:
        if cancelled:  # the app caught the cancellation itself (a client gone as it answered)
            task.uncancel()
    finally:
        start.cancel()
        for watcher in watching:
            watcher.cancel()
