"""The HTTP/1.1 connection: uvicorn's httptools protocol with the bounds on a request's head (its request line and
headers) that uvicorn lacks, and its own refusals in the service's problem+json.

- Size: httptools buffers a header of any length before it hands it over (a 200 MiB header was read whole and
  answered 200); a head over `max_head_bytes` is answered 431 and the connection closed, having buffered at most
  that plus one read.
- Time: a connection may hold a half-sent head for ever (a byte every few seconds keeps it open; so does a
  connection that sends nothing: uvicorn times out only idle kept-alive ones), and enough of them use up the
  process' file descriptors, after which no client is served. A head must arrive within `head_timeout_s` of the
  connection's opening or of its first byte: a partial one is answered 408, a connection that sent nothing closed.
- uvicorn answers a request it cannot parse with a text/plain 400; here it is a problem+json 400 like every other.

The body has its own bounds (security.BodyLimitMiddleware: max_body_bytes, body_timeout_s).
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .errors import PROBLEM_JSON, problem_body

access_log = logging.getLogger("vlserve.access")


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's protocol with the bounds of the module doc; `bounded_head_protocol` sets them."""

    max_head_bytes = 65536
    head_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head = False  # a request's head has begun and is not complete
        self._head_bytes = 0  # the bytes read since it began
        self._heads_done = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._start_head_timer()

    def _start_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        self._start_head_timer()  # a pipelined head, read while an earlier request runs

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._heads_done += 1
        self._stop_head_timer()
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:  # no request running: these bytes begin a head
            self._start_head_timer()  # (on a kept-alive connection, uvicorn's idle timer stops at its first byte)
        done = self._heads_done
        super().data_received(data)
        if not self._in_head or self.transport.is_closing():
            return
        # the bytes of a head still arriving; when one completed in this read and another began, that one's bytes in
        # this read are not counted (at most one read's worth)
        if self._heads_done == done:
            self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes:
            self._refuse(431, f"the request's head (request line and headers) is over the limit of "
                              f"{self.max_head_bytes} bytes (max_head_bytes)", "head-too-large")

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:  # a pipelined head behind a running request
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_too_slow)
            return
        if not self._in_head:
            self.transport.close()  # no request began: nothing to answer
            return
        self._refuse(408, f"the request's head did not arrive within {self.head_timeout_s:g} s (head_timeout_s)")

    def send_400_response(self, msg: str) -> None:  # httptools could not parse the request
        self._refuse(400, "not a valid HTTP/1.1 request")

    def _refuse(self, status: int, detail: str, kind: str | None = None) -> None:
        """Answer `status` as problem+json and close the connection; one whose answer to an earlier request is still
        being written is only closed after it."""
        self._stop_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
            self.transport.pause_reading()
            return
        rid = uuid.uuid4().hex
        body = json.dumps(problem_body(status, detail, "", rid, kind, HTTPStatus(status).phrase)).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: ", PROBLEM_JSON.encode(), b"\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\nx-request-id: ", rid.encode(), b"\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        fields = {"request_id": rid, "client": client, "method": "-", "path": "-", "endpoint": None,
                  "status": status, "duration_ms": None}
        access_log.info("%s - - %d - request_id=%s", client, status, rid, extra=fields)


def bounded_head_protocol(max_head_bytes: int, head_timeout_s: float) -> type[BoundedHeadProtocol]:
    """The protocol class uvicorn.Config(http=...) takes, with these bounds."""
    return type("BoundedHeadProtocol", (BoundedHeadProtocol,),
                {"max_head_bytes": max_head_bytes, "head_timeout_s": head_timeout_s})
