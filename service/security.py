"""Optional API keys (X-API-Key) and the request body's checks, as pure ASGI middleware.

Both answer before the route runs: an unauthenticated client cannot make the service buffer a large body; a large
body is refused at its Content-Length or as soon as the streamed bytes pass the limit; a body the route could not
read (a compressed one, or one whose Content-Type is not what the route reads) is refused before it is read; a body
that stops arriving is answered 408 instead of holding its connection and its request open for ever.
"""
from __future__ import annotations

import asyncio
import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import send_problem, shown

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
    request, its connection and its buffered bytes open for ever; a slow client that keeps sending is served).

    The body is read here (at most max_bytes of it) and replayed to the app, so the app never sees a
    partial body and the 413 is always a complete problem+json answer.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, body_types: dict[str, tuple[str, ...]]):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.body_types = body_types  # path -> the media types its route reads; paths not named read any

    def too_large(self) -> str:
        return f"request body is over the limit of {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await send_problem(scope, send, 400, "Content-Length is not a number")
            if declared > self.max_bytes:
                return await send_problem(scope, send, 413, self.too_large())
        coding = headers.get(b"content-encoding", b"").decode("latin-1").strip().lower()
        if coding not in ("", "identity"):
            return await send_problem(scope, send, 415, f"Content-Encoding {shown(coding)} is not supported: "
                                      "send the body uncompressed", headers={"Accept-Encoding": "identity"})
        content_type = headers.get(b"content-type")
        content_type = content_type.decode("latin-1") if content_type is not None else None
        allowed = self.body_types.get(scope.get("path", ""))
        if not readable(allowed, content_type):
            wanted = " or ".join(allowed)
            return await send_problem(scope, send, 415, f"this route reads a body of type {wanted}, not "
                                      f"{shown(media_type(content_type))}; send JSON with Content-Type: application/json")
        if allowed is not None and content_type is None:  # read as JSON: say so to the route's parser
            scope = {**scope, "headers": [*scope["headers"], (b"content-type", JSON_TYPES[0].encode())]}
        chunks, total = [], 0
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(None) as deadline:  # one timer for the whole body, moved on at each chunk
                while True:
                    deadline.reschedule(loop.time() + self.timeout_s)
                    message = await receive()
                    if message["type"] != "http.request":  # client went away: let the app see it
                        chunks.append(message)
                        break
                    total += len(message.get("body", b""))
                    if total > self.max_bytes:
                        break
                    chunks.append(message)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await send_problem(scope, send, 408, f"no byte of the request body arrived for "
                                      f"{self.timeout_s:g} s (body_timeout_s)", headers={"Connection": "close"})
        if total > self.max_bytes:
            return await send_problem(scope, send, 413, self.too_large())
        body = b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request")
        replay: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
        replay += [m for m in chunks if m["type"] != "http.request"]

        async def replayed() -> Message:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replayed, send)
