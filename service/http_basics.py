"""HTTP behaviour every route shares, as pure ASGI middleware: HEAD answered as GET without its body (RFC 9110
9.3.2: uptime checks and load balancers probe with HEAD; a 405's Allow says so), and the request id on every answer
(X-Request-ID: the client's when it sent a sane one, else the service's; errors.request_id), successes included, so
a client can quote it for any request it made."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import request_id
from .metrics import ENDPOINT


def with_head(allow: bytes) -> bytes:
    """A 405's Allow with HEAD wherever GET is: the routes list GET only, and HEAD is answered as GET here."""
    methods = [m.strip() for m in allow.split(b",") if m.strip()]
    if b"GET" in methods and b"HEAD" not in methods:
        methods.insert(methods.index(b"GET") + 1, b"HEAD")
    return b", ".join(methods)


class HTTPBasics:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = scope
        if scope["method"] == "HEAD":  # the server that made the scope sends no body for it (uvicorn and h11 both)
            scope = {**scope, "method": "GET"}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(name == b"x-request-id" for name, _ in headers):  # the app's headers are lower case
                    headers.append((b"x-request-id", request_id(scope).encode("latin-1", "replace")))
                if message["status"] == 405:
                    headers = [(name, with_head(value) if name.lower() == b"allow" else value) for name, value in headers]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            for key in ("route", ENDPOINT):  # what routing found, for the metrics' label (the copy is not theirs)
                if scope is not given and key in scope:
                    given[key] = scope[key]
