"""Graceful shutdown with a drain period, so that a replica leaves a load balancer without losing a request.

On the first SIGTERM or SIGINT the service drains for `shutdown_drain_s`: /readyz answers 503 (and `vlserve_ready`
is 0) so that load balancers stop routing here, while every request that still comes is served as usual; each
answer carries `Connection: close`, so a kept-alive client opens its next connection through the load balancer
rather than reusing this one. Then the listener stops taking new connections (drop_new_connections), and after
SETTLE_S uvicorn's own graceful shutdown runs: the listener closes, connections with a request in flight finish it
(up to `shutdown_timeout_s`), idle ones close, the lifespan ends.
A second signal ends the drain at once; a Ctrl-C after that stops waiting for in-flight requests, as in uvicorn.

Why: uvicorn alone closes idle kept-alive connections the moment the signal comes, so a request a client sends
on one of them at that moment gets a reset connection, and a load balancer sees the replica go from ready straight
to connection refused.
"""
from __future__ import annotations

import ctypes
import logging
import signal
import socket
import struct
import sys
import time
from types import FrameType

import uvicorn
from starlette.datastructures import State
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("vlserve.app")

# From the end of the drain to uvicorn's shutdown (which closes the listener and every connection with no request in
# flight): long enough for the event loop to accept the connections the kernel has already queued and to start
# their requests, which uvicorn then lets finish.
SETTLE_S = 0.5

# Classic BPF socket filter (struct sock_filter: code, jt, jf, k) that drops TCP segments with SYN set and ACK clear,
# i.e. new connection attempts; a socket filter on a TCP socket sees the packet from the TCP header, whose byte 13
# holds the flags. Attached to a listening socket, no new handshake completes, while the connections the kernel
# already queued wait to be accepted and established ones are untouched. Closing a listener instead resets every
# queued connection, whose client has already sent its request; a client whose SYN was dropped retries it after
# about 1 s and then finds the port closed (connection refused).
_SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
_DROP_SYN = b"".join(struct.pack("HBBI", *insn) for insn in (
    (0x30, 0, 0, 13),  # ldb [13]        A = TCP flags
    (0x54, 0, 0, 0x12),  # and #0x12     A &= SYN | ACK
    (0x15, 0, 1, 0x02),  # jeq #SYN      only SYN set: drop, else accept
    (0x06, 0, 0, 0),  # ret #0           drop
    (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1 accept the whole packet
))


def drop_new_connections(sock: socket.socket) -> bool:
    """Attach the _DROP_SYN filter to a listening TCP socket; False where the platform has no socket filters
    (not Linux) or the socket is not TCP, and the caller closes the listener instead."""
    if sys.platform != "linux" or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    code = ctypes.create_string_buffer(_DROP_SYN, len(_DROP_SYN))
    program = struct.pack("HL", len(_DROP_SYN) // 8, ctypes.addressof(code))  # struct sock_fprog; the kernel copies it
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, program)
    except OSError:
        return False
    return True


class CloseWhileDraining:
    """Adds `Connection: close` to every answer started while `state.draining`; uvicorn then closes the connection
    once the answer is sent (httptools and h11 alike), and the client's next request opens a new one."""

    def __init__(self, app: ASGIApp, state: State):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and state.draining:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, sending)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with the drain period before its graceful shutdown; `state` is the app's (app.state)."""

    def __init__(self, config: uvicorn.Config, state: State, drain_s: float):
        super().__init__(config)
        self.state = state
        self.drain_s = drain_s
        self.drain_ends: float | None = None  # time.monotonic() when the drain period is over
        self.exit_at: float | None = None  # time.monotonic() when uvicorn's shutdown starts (listener closed by then)
        self.drain_announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it only sets attributes (no locks, no logging); on_tick acts on them in the event loop.
        # Unlike uvicorn's own, it does not record the signal to raise it again once the server has stopped (the
        # process would die of it): after a clean shutdown `vlserve serve` exits 0.
        if self.started and self.drain_s > 0 and self.drain_ends is None and not self.should_exit:
            self.state.draining = True
            self.drain_ends = time.monotonic() + self.drain_s  # on_tick sets should_exit after it
        elif self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # Ctrl-C during the graceful shutdown: stop waiting for in-flight requests
        else:
            self.should_exit = True  # before start-up finished, a second signal during the drain, or no drain

    async def on_tick(self, counter: int) -> bool:
        # uvicorn calls this every 0.1 s from its main loop, which ends once it returns True
        if self.drain_ends is not None and not self.should_exit:
            if not self.drain_announced:
                self.drain_announced = True
                self.state.metrics.ready.set(0)
                log.info("shutting down: /readyz answers 503 for %.1f s while requests are still served "
                         "(a second SIGTERM or SIGINT ends this at once)", self.drain_s)
            now = time.monotonic()
            if self.exit_at is None and now >= self.drain_ends:
                for server in self.servers:
                    if not all(map(drop_new_connections, server.sockets)):
                        server.close()  # uvicorn's shutdown closes it too (a second close does nothing)
                self.exit_at = now + SETTLE_S
            elif self.exit_at is not None and now >= self.exit_at:
                self.should_exit = True
        return await super().on_tick(counter)
