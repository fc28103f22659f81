"""Holding a service's work in tests: a batcher's batch function held until released (Gate), waiting for a
condition, a call in a thread; shared by the tests of disconnects and of long work's admission."""
from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

DEADLINE_S = 30


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


class Gate:
    """A batcher's batch function held: each call waits for a permit (release) or for the gate to open; `rows` is
    the size of every call that entered."""

    def __init__(self, batcher) -> None:
        self.batcher, self.run = batcher, batcher.fn
        self.original = batcher.fn
        self.permits = threading.Semaphore(0)
        self.opened = threading.Event()
        self.rows: list[int] = []

    def __enter__(self) -> Gate:
        def held(items):
            self.rows.append(len(items))
            while not self.opened.is_set() and not self.permits.acquire(timeout=0.01):
                pass
            return self.run(items)

        self.batcher.fn = held
        return self

    def __exit__(self, *exc) -> None:
        self.open()
        self.batcher.fn = self.original

    @property
    def entered(self) -> int:
        return len(self.rows)

    def release(self, n: int = 1) -> None:
        self.permits.release(n)

    def open(self) -> None:
        self.opened.set()


def in_thread(call) -> tuple[threading.Thread, dict]:
    """call() in a thread; its result in the dict's "r"."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=call()))
    thread.start()
    return thread, out


def encoder(c: TestClient, kind: str):
    pipeline = c.app.state.services.pipeline
    return pipeline.batchers[pipeline.specs[kind].task]
