"""HTTP behaviour every route shares, as pure ASGI middleware: HEAD answered as GET without its body (RFC 9110
9.3.2: uptime checks and load balancers probe with HEAD), and the request id on every answer (X-Request-ID: the
client's when it sent a sane one, else the service's; errors.request_id), successes included, so a client can quote
it for any request it made."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import request_id
from .metrics import ENDPOINT


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
                headers = message.get("headers", ())
                if not any(name == b"x-request-id" for name, _ in headers):  # the app's headers are lower case
                    rid = request_id(scope).encode("latin-1", "replace")
                    message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            for key in ("route", ENDPOINT):  # what routing found, for the metrics' label (the copy is not theirs)
                if scope is not given and key in scope:
                    given[key] = scope[key]
