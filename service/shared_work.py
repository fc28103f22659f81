"""Work that several requests wait for (one image's detection, one image's query-bank prior): it runs once, in a task
of its own, for as long as any of them waits, and stops when the last one stops waiting (its client went away), never
while another still does."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class SharedWork(Generic[T]):
    """`await work.join()` for its result. Its owner keeps it (by key) for later callers to join while it is not
    `abandoned`: once it is, the task has been cancelled and a later caller starts the work anew."""

    def __init__(self, coro: Coroutine[Any, Any, T], name: str) -> None:
        self.task: asyncio.Task[T] = asyncio.get_running_loop().create_task(coro, name=name)
        self.task.add_done_callback(_retrieve)
        self.waiters = 0
        self.abandoned = False

    async def join(self) -> T:
        """The work's result (or its exception); a caller that is cancelled stops waiting, and the work stops with
        the last caller."""
        self.waiters += 1
        try:
            return await asyncio.shield(self.task)
        finally:
            self.waiters -= 1
            if self.waiters == 0 and not self.task.done():
                self.abandoned = True
                self.task.cancel()


def _retrieve(task: asyncio.Task) -> None:
    """Mark a failure as seen: when nobody waits for it any more it is not logged as "never retrieved"."""
    if not task.cancelled():
        task.exception()
