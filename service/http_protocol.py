"""The HTTP/1.1 connection: uvicorn's httptools protocol with the bounds on a request's head (its request line and
headers) that uvicorn lacks, and its own refusals in the service's problem+json.

- Size: httptools buffers a header of any length before it hands it over; a head over `max_head_bytes` is answered
  431 and the connection closed, having buffered at most that plus two reads.
- Time: a connection may hold a half-sent head for ever (a byte every few seconds keeps it open; so does a
  connection that sends nothing: uvicorn times out only idle kept-alive ones), and enough of them use up the
  process' file descriptors, after which no client is served. A head must arrive within `head_timeout_s` of the
  connection's opening or of its first byte: a partial one is answered 408, a connection that sent nothing closed.
  So must the rest of a body the answer did not wait for (an early 413 or 415), or the connection is closed.
- uvicorn answers a request it cannot parse (its head, or the framing of its body) with a text/plain 400; here it
  is a problem+json 400 like every other, and so is an HTTP/1.1 request without exactly one Host header (which
  uvicorn serves). A transfer coding other than chunked (`gzip, chunked`, which uvicorn de-chunks and hands on
  still compressed) is a 501.

Each refusal, and each connection closed having sent nothing, is reported to `on_refusal` (the app's metrics); a
refused request pipelined behind one still running is not answered: the connection closes after that one's answer.

The body has its own bounds (security.BodyLimitMiddleware: max_body_bytes, body_timeout_s).
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .errors import PROBLEM_JSON, problem_body

access_log = logging.getLogger("vlserve.access")


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's protocol with the bounds of the module doc; `bounded_head_protocol` gives them (the settings')."""

    max_head_bytes: int
    head_timeout_s: float
    on_refusal: Callable[[int | None], None] | None = None  # told the status answered, None for a silent close

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head = False  # a request's head has begun and is not complete
        self._in_message = False  # a request has begun and its body is not all read
        self._head_bytes = 0  # the bytes read since its head began (a lower bound: see data_received)
        self._heads_done = self._messages_done = 0
        self._refused = False  # answered or closed here: the parser's further callbacks do nothing
        self._head_timer: asyncio.TimerHandle | None = None
        self._start_head_timer()  # the first head, from the connection's opening

    def _start_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        # bytes that begin a head (uvicorn's idle timer of a kept-alive connection stops at them), or the rest of a
        # body the answer did not wait for (an early 413 or 415): either must come within head_timeout_s
        if not self._in_message or self.cycle is not None and self.cycle.response_complete:
            self._start_head_timer()
        heads, messages = self._heads_done, self._messages_done
        super().data_received(data)
        if self._refused or not self._in_head or self.transport.is_closing():
            return
        # A head still arriving. Where no request ended and no head completed in this read, every byte of it is this
        # head's; where one did, this head began within the read at an offset unknown here, so the read is not counted
        # (the count stays a lower bound, by at most one read; a complete head is measured exactly in
        # on_headers_complete).
        if (self._heads_done, self._messages_done) == (heads, messages):
            self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes:
            self._head_too_large()

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self._in_head = self._in_message = True
        self._head_bytes = 0
        self._start_head_timer()  # a pipelined head, read while an earlier request runs

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head = False
        self._heads_done += 1
        self._stop_head_timer()
        if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > self.max_head_bytes:
            self._head_too_large()  # a head that came whole within a read: never handed to the app
            return
        hosts = sum(name == b"host" for name, _ in self.headers)
        if self.parser.get_http_version() == "1.1" and hosts != 1:  # RFC 9112 3.2: a 400
            self._refuse(400, f"an HTTP/1.1 request has exactly one Host header, not {hosts}")
            return
        codings = [c.strip().lower() for name, value in self.headers if name == b"transfer-encoding"
                   for c in value.split(b",") if c.strip()]
        if codings and codings != [b"chunked"]:  # RFC 9112 6.1: a coding not understood is a 501
            unknown = next(c for c in codings if c != b"chunked").decode("latin-1")[:64]
            self._refuse(501, f"Transfer-Encoding {unknown!r} is not supported: send the body chunked or with a "
                              "Content-Length", "not-implemented")
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._in_message = False
        self._messages_done += 1
        self._stop_head_timer()  # the rest of an answered body came; the next head's clock starts at its first byte
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._in_head and not self.transport.is_closing():  # a pipelined head has begun: its clock, not idleness
            self._unset_keepalive_if_required()
            self._start_head_timer()

    def _head_too_large(self) -> None:
        self._refuse(431, f"the request's head (request line and headers) is over the limit of {self.max_head_bytes} "
                          "bytes (max_head_bytes)", "head-too-large")

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._refused or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:  # a pipelined head behind a running request
            self._start_head_timer()
            return
        if not self._in_head:
            self._refused = True
            self.transport.close()  # no request began: nothing to answer
            self._report(None)
            return
        self._refuse(408, f"the request's head did not arrive within {self.head_timeout_s:g} s (head_timeout_s)")

    def send_400_response(self, msg: str) -> None:  # httptools could not parse the request
        self._refuse(400, "not a valid HTTP request")

    def _refuse(self, status: int, detail: str, kind: str | None = None) -> None:
        """Answer `status` as problem+json and close the connection. A request whose answer is being written keeps it:
        where the refusal is of a later (pipelined) request, the connection closes after that answer; where it is of
        this request's own body (its framing), the connection closes now, answered only if the app had not begun to."""
        self._refused = True
        self._stop_head_timer()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if not cycle.more_body:  # a later request: after this answer, no other (it is counted, not answered)
                cycle.keep_alive = False
                self.flow.pause_reading()
                self._report(status)
                return
            if cycle.response_started:
                self.transport.close()  # the app's answer cannot be finished
                return
        rid = uuid.uuid4().hex
        body = json.dumps(problem_body(status, detail, "", rid, kind, HTTPStatus(status).phrase)).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: ", PROBLEM_JSON.encode(), b"\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\nx-request-id: ", rid.encode(), b"\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()  # an app still reading the body is told the client left (connection_lost)
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        fields = {"request_id": rid, "client": client, "method": "-", "path": "-", "endpoint": None,
                  "status": status, "duration_ms": None}
        access_log.info("%s - - %d - request_id=%s", client, status, rid, extra=fields)
        self._report(status)

    def _report(self, status: int | None) -> None:
        if self.on_refusal is not None:
            self.on_refusal(status)


def bounded_head_protocol(max_head_bytes: int, head_timeout_s: float,
                          on_refusal: Callable[[int | None], None] | None = None) -> type[BoundedHeadProtocol]:
    """The protocol class uvicorn.Config(http=...) takes, with these bounds, reporting its refusals to `on_refusal`."""
    return type("BoundedHeadProtocol", (BoundedHeadProtocol,),
                {"max_head_bytes": max_head_bytes, "head_timeout_s": head_timeout_s,
                 "on_refusal": staticmethod(on_refusal) if on_refusal else None})
