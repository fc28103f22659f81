"""Graceful shutdown with a drain period, so that a replica leaves a load balancer without losing a request.

On the first SIGTERM or SIGINT the service drains for `shutdown_drain_s`: /readyz answers 503 (and `vlserve_ready`
is 0) so that load balancers stop routing here, while every request that still comes is served as usual; each
answer carries `Connection: close`, so a kept-alive client opens its next connection through the load balancer
rather than reusing this one. Then the listener stops taking new connections (drop_new_connections), and after
SETTLE_S uvicorn's own graceful shutdown runs: the listener closes, connections with a request in flight finish it
(up to `shutdown_timeout_s`), idle ones close, the lifespan ends.
A second signal ends the drain at once; a Ctrl-C after that stops waiting for in-flight requests, as in uvicorn.

The whole shutdown is bounded by `shutdown_drain_s + shutdown_timeout_s` (plus SETTLE_S, ANSWER_S and the exit):
- `shutdown_timeout_s` after the listener closed, the app's `state.out_of_time()` fails the work still queued or
  running in its batchers (BatcherClosedError: 503 /problems/not-ready with Retry-After), and those requests answer;
- ANSWER_S later uvicorn cancels any request still running (a slow body, a hung store); CloseWhileDraining answers
  it 503 not-ready too, so no request gets uvicorn's text/plain 500 and no traceback reaches the log;
- the lifespan's shutdown (batchers, detector, feature store) shares the same deadline (`state.shutdown_deadline`)
  rather than waiting again;
- a batch still running on the inference thread cannot be interrupted, and the interpreter would wait for that
  thread at exit (ThreadPoolExecutor's threads are joined): the lifespan flags it (`state.inference_abandoned`)
  and run() ends the process at once (os._exit(0)) after a clean shutdown.

Why: uvicorn alone closes idle kept-alive connections the moment the signal comes, so a request a client sends
on one of them at that moment gets a reset connection, and a load balancer sees the replica go from ready straight
to connection refused.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import FrameType
from typing import Any

import uvicorn
from starlette.datastructures import State
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import SHUTTING_DOWN, send_problem

log = logging.getLogger("vlserve.shutdown")

# From the end of the drain to uvicorn's shutdown (which closes the listener and every connection with no request in
# flight): long enough for the event loop to accept the connections the kernel has already queued and to start
# their requests, which uvicorn then lets finish.
SETTLE_S = 0.5
# From the end of shutdown_timeout_s, when the batchers' work is failed (requests answer 503 at once), to uvicorn's
# cancelling the requests still running: time for those answers to be written.
ANSWER_S = 0.5

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
    once the answer is sent (httptools and h11 alike), and the client's next request opens a new one.

    A request that uvicorn cancels because the shutdown timeout ran out (`state.stopping`, set by DrainingServer)
    answers 503 /problems/not-ready with Retry-After instead of uvicorn's text/plain 500 and its logged traceback."""

    def __init__(self, app: ASGIApp, state: State):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if state.draining:
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if not getattr(state, "stopping", False):
                raise
            # uvicorn's graceful-shutdown timeout: this task ends here, answered (uvicorn awaits it no longer)
            if not started:
                await send_problem(scope, sending, 503, SHUTTING_DOWN, "not-ready", headers={"Retry-After": "1"})


class InferenceExecutor(ThreadPoolExecutor):
    """The one inference thread (app.lifespan), which also knows whether a call is running on it: the one thing a
    shutdown cannot interrupt, and that the interpreter would wait for at exit."""

    def __init__(self, thread_name_prefix: str = "vlserve-inference") -> None:
        super().__init__(1, thread_name_prefix=thread_name_prefix)
        self.busy = False  # a call is running on the thread (its one worker is the only writer: no lock needed)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return super().submit(self._marked, fn, args, kwargs)

    def _marked(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.busy = True
        try:
            return fn(*args, **kwargs)
        finally:
            self.busy = False


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with the drain period before its graceful shutdown, and the shutdown bounded as the module
    doc says; `state` is the app's (app.state). `config.timeout_graceful_shutdown` is the app's shutdown_timeout_s:
    in-flight requests get that long, then the work still queued fails (503), and uvicorn cancels what is left
    ANSWER_S later (its own timeout is set to that)."""

    def __init__(self, config: uvicorn.Config, state: State, drain_s: float):
        self.timeout_s: float | None = config.timeout_graceful_shutdown
        if self.timeout_s is not None:
            config.timeout_graceful_shutdown = self.timeout_s + ANSWER_S
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
        ready = getattr(self.state, "ready", False)  # still loading: no load balancer routes here, nothing to drain
        if self.started and ready and self.drain_s > 0 and self.drain_ends is None and not self.should_exit:
            self.state.draining = True
            self.drain_ends = time.monotonic() + self.drain_s  # on_tick sets should_exit after it
        elif self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # Ctrl-C during the graceful shutdown: stop waiting for in-flight requests
        else:
            self.should_exit = True  # while loading, a second signal during the drain, or no drain

    async def on_tick(self, counter: int) -> bool:
        # uvicorn calls this every 0.1 s from its main loop, which ends once it returns True
        if getattr(self.state, "startup_error", None) and not self.should_exit:
            self.should_exit = True  # loading the models (in the background: app.lifespan) failed
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

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown (listener closed, in-flight requests finish, then the lifespan's), with the deadline:
        shutdown_timeout_s from now the app's batchers fail their work (state.out_of_time) and the lifespan's own
        shutdown stops by then too (state.shutdown_deadline)."""
        self.state.stopping = True
        timer = None
        if self.timeout_s is not None:
            self.state.shutdown_deadline = time.monotonic() + self.timeout_s
            timer = asyncio.get_running_loop().call_later(self.timeout_s, self._out_of_time)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    def _out_of_time(self) -> None:
        out_of_time = getattr(self.state, "out_of_time", None)
        failed = out_of_time() if out_of_time is not None else 0
        if failed:
            log.warning("shutdown: shutdown_timeout_s (%g s) ran out; %d request(s) still queued or running answer "
                        "503 not-ready", self.timeout_s, failed)

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        super().run(sockets)
        if self.started and getattr(self.state, "inference_abandoned", False):
            # The inference thread is still running a batch that cannot be interrupted, and the interpreter would
            # join it at exit (seconds to minutes on a slow detector, past the pod's grace period): exit now, the
            # shutdown being otherwise complete.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
