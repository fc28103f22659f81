"""Dynamic batching: one future per request, one consumer task per queue, inference in an executor thread.

The consumer takes the first queued item and dispatches at once when the runtime is idle (no batch of any
batcher sharing its `InFlight` is running or waiting to run), with whatever else is queued, up to
`max_batch_size`. While the runtime is busy, the batch keeps filling until it has `max_batch_size` items,
its first item has waited `max_wait_ms`, or the runtime becomes idle, whichever comes first (continuous
batching: under load, batches form from the requests that arrive while the previous batch runs; a lone
request never waits). The synchronous batch function runs in the executor, so the event loop never blocks
on inference. Overload becomes `QueueFullError` (HTTP 429 with Retry-After) at submit: when the queue holds
`max_queue` items, or when the batches queued ahead of a new request on the shared runtime (those it cannot join,
at the measured batch time) would hold it longer than `max_queue_wait_ms`. The batch running when it arrives is not
counted: a request that can join the next batch is always taken, whatever the batch time. Shedding by expected wait
keeps the accepted requests' latency bounded where a long queue would only make every request late. A caller
with work of its own between admission and submit (decoding an image for the detector) takes a `Reservation`
(reserve()): it counts as queued until the item is submitted, so requests admitted meanwhile see it ahead of them.

At shutdown, stop(timeout_s) finishes the queued work within the timeout and fails the rest with BatcherClosedError
(HTTP 503); close_now() fails every queued item and the running batch's at once (the shutdown budget has run out: a
batch running in the executor cannot be interrupted, its results are dropped).

Background items (`submit(item, background=True)`: work no request waits for, such as an image's query-bank prior
after its registration) never go ahead of a request: they run only while no request is queued in any batcher
sharing the runtime and the runtime is idle, in batches of at most BACKGROUND_BATCH, so a request that arrives
meanwhile waits for one small batch at most. They do not count against `max_queue` (their producer bounds them).

Bulk items (`submit(item, bulk=True)`: long work of an admitted request, such as the query-bank rows of a text -> image
request over new images, hundreds of rows a batch at a time) go behind the requests too, but are never starved: a
bulk batch runs when no request is queued on the runtime and it is idle, or as soon as a request batch has run on the
runtime since the lane's last turn (under load, every other batch). Admission does not count them (a request arriving
meanwhile waits for one bulk batch at most, not for all of them) and neither does `max_queue`: one request's long
work never makes the service refuse the others.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sized
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger("vlserve.batcher")

# Items per background batch: small, because a request that arrives while one runs waits for it (8 rows of the demo
# encoder run in about a quarter of a 32-row batch's time).
BACKGROUND_BATCH = 8


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int  # items per call of the batch function
    max_wait_ms: float  # while the runtime is busy, how long a batch may wait to fill, from its first item's arrival
    max_queue: int  # items waiting (not yet in a running batch) before submit raises QueueFullError
    max_queue_wait_ms: float = 0.0  # refuse a request whose expected wait is longer (0: no bound but max_queue)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 <= self.max_wait_ms < math.inf:  # also rejects NaN
            raise ValueError(f"max_wait_ms must be finite and >= 0, got {self.max_wait_ms}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if not 0 <= self.max_queue_wait_ms < math.inf:
            raise ValueError(f"max_queue_wait_ms must be finite and >= 0, got {self.max_queue_wait_ms}")


class QueueFullError(Exception):
    """The batcher cannot take a request now (queue full, or the wait would be too long); try again after
    `retry_after_s` (HTTP 429 with Retry-After)."""

    def __init__(self, name: str, why: str, retry_after_s: float) -> None:
        super().__init__(f"{name}: {why}; retry in {retry_after_s:.2f} s")
        self.name = name
        self.retry_after_s = retry_after_s


class BatcherClosedError(RuntimeError):
    """submit() on a batcher that is not started or is shutting down, or a request whose item the shutdown failed
    (HTTP 503 not-ready)."""


class Reservation:
    """A request admitted by Batcher.reserve() whose item is not submitted yet: it counts as queued (for the
    expected wait and max_queue of later requests) until submit(item, reservation=...) or release()."""

    def __init__(self, batcher: Batcher) -> None:
        self._batcher: Batcher | None = batcher
        batcher._reserved += 1

    def release(self) -> None:
        """Stop counting it (idempotent: call it in a finally, whether or not the item was submitted)."""
        if self._batcher is not None:
            self._batcher._reserved -= 1
            self._batcher = None


class InFlight:
    """Batches handed to one runtime and not finished yet, counted across the batchers that share it.

    Batchers that feed one runtime (one executor) share one InFlight, so a batch dispatches at once only
    when the runtime is really idle. Every finished batch wakes the listening batchers: a batch that is
    filling while the runtime is busy goes as soon as the runtime is free.
    """

    def __init__(self) -> None:
        self.count = 0
        self._listeners: list[asyncio.Event] = []
        self._batchers: list[Batcher] = []  # the batchers that feed this runtime
        self.request_batches = 0  # request batches finished on this runtime (bulk work takes turns with them)
        self.batch_seconds: float | None = None  # moving average of a batch's run time on this runtime
        self._provisional = False  # batch_seconds is expect()'s estimate, not yet measured
        self._running_since = 0.0  # time.perf_counter() when the oldest running batch started

    @property
    def idle(self) -> bool:
        return self.count == 0

    @property
    def requests_waiting(self) -> bool:
        """Whether any batcher feeding this runtime has a request (not background work) queued."""
        return any(b.requests_waiting for b in self._batchers)

    def join(self, batcher: Batcher) -> None:
        if batcher not in self._batchers:
            self._batchers.append(batcher)

    def leave(self, batcher: Batcher) -> None:
        if batcher in self._batchers:
            self._batchers.remove(batcher)

    def listen(self, event: asyncio.Event) -> None:
        self._listeners.append(event)

    def unlisten(self, event: asyncio.Event) -> None:
        if event in self._listeners:
            self._listeners.remove(event)

    def expect(self, batch_seconds: float) -> None:
        """A batch time to admit by until one is measured (e.g. timed at warm-up); the first measured batch replaces
        it."""
        if self.batch_seconds is None or self._provisional:
            self.batch_seconds = batch_seconds
            self._provisional = True

    def expected_wait_s(self, joining: Batcher | None = None) -> tuple[float, float]:
        """(queued, running): how long a request submitted now to `joining` would wait for the work queued ahead of
        it and for the rest of the batch running now; (0, 0) until a batch time has been measured. Queued work is
        counted in batch times: in its own batcher the full batches it cannot join, in every other batcher the
        fraction of a full batch that is queued there (a lone request of another task is a short batch, not a
        whole batch time)."""
        if self.batch_seconds is None:  # nothing measured yet (start-up): no basis for refusing
            return 0.0, 0.0
        ahead = sum(b.requests_waiting // b.config.max_batch_size if b is joining
                    else b.requests_waiting / b.config.max_batch_size for b in self._batchers)
        running = max(self.batch_seconds - (time.perf_counter() - self._running_since), 0.0) if self.count else 0.0
        return ahead * self.batch_seconds, running

    def started(self) -> None:
        if self.count == 0:
            self._running_since = time.perf_counter()
        self.count += 1

    def finished(self, run_s: float | None = None, request: bool = True) -> None:
        """A batch ended; run_s: its run time, to admit by (None: not representative); request: a batch of requests
        (not bulk or background work)."""
        self.count -= 1
        self.request_batches += request
        if run_s is not None:
            measured = self.batch_seconds is not None and not self._provisional
            self.batch_seconds = 0.8 * self.batch_seconds + 0.2 * run_s if measured else run_s
            self._provisional = False
        if self.count:
            self._running_since = time.perf_counter()
        for event in self._listeners:
            event.set()


@dataclass
class _Pending(Generic[T, R]):
    item: T
    future: asyncio.Future[R]
    enqueued: float  # loop.time() at submit
    background: bool = False
    bulk: bool = False


def retry_after(queue_depth: int, max_batch_size: int, batch_seconds: float, max_wait_s: float) -> float:
    """Seconds until a request queued now would likely start: the batches ahead times a batch's run time."""
    batches_ahead = math.ceil((queue_depth + 1) / max_batch_size)
    return max(batches_ahead * batch_seconds, max_wait_s, 0.001)


def check_results(results: object, n: int) -> list:
    """The batch function's return value (a list, tuple or array of rows) as a list of n results, or a clear RuntimeError."""
    if isinstance(results, (str, bytes, Mapping)) or not isinstance(results, Sized) or not isinstance(results, Iterable):
        raise RuntimeError(f"batch function returned {type(results).__name__}, expected a list of {n} results")
    if len(results) != n:
        raise RuntimeError(f"batch function returned {len(results)} results for a batch of {n}")
    return list(results)


class Batcher(Generic[T, R]):
    """Collects concurrent `submit(item)` calls into batches for a synchronous `fn(items) -> results`.

    `fn` runs in `executor` (by default a private one-thread pool, shut down by stop()); batchers that share
    an executor should share `in_flight` too (by default a private one). If `fn` raises on a batch of several
    items, each item runs again alone, so only the requests whose own item fails get an exception (one request's bad
    input never fails the others); a result that is an Exception instance fails only its own request.
    `on_batch(batch_size, max_queue_wait_s, run_s)` is called after every batch (metrics).
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[list[T]], list[R]],
        config: BatcherConfig,
        executor: Executor | None = None,
        on_batch: Callable[[int, float, float], None] | None = None,
        in_flight: InFlight | None = None,
    ) -> None:
        self.name = name
        self.fn = fn
        self.config = config
        self.on_batch = on_batch
        self._executor = executor
        self._own_executor = executor is None
        self._in_flight = in_flight if in_flight is not None else InFlight()
        self._queue: deque[_Pending[T, R]] = deque()
        self._background: deque[_Pending[T, R]] = deque()  # run only when no request waits (see the module doc)
        self._bulk: deque[_Pending[T, R]] = deque()  # requests' long work: behind requests, never starved (module doc)
        self._bulk_turn_at = 0  # its turn comes once the runtime's request_batches passes this
        self._filling = 0  # requests taken from the queue into a batch that is still filling
        self._reserved = 0  # requests admitted by reserve() that have not submitted their item yet
        self._running: list[_Pending[T, R]] = []  # the batch handed to the executor, until it returns
        self._out_of_time: BatcherClosedError | None = None  # set by close_now(): nothing more runs
        self._arrived: asyncio.Event | None = None
        self._consumer: asyncio.Task | None = None
        self._closing = False
        self._batch_seconds = config.max_wait_ms / 1000  # moving average of fn's run time, for Retry-After
        self.batches = 0  # batches run
        self.items = 0  # items run
        self.shed = 0  # requests refused by expected wait

    @property
    def queue_depth(self) -> int:
        """Items waiting for a batch (cancelled ones included until the consumer drops them)."""
        return len(self._queue)

    @property
    def requests_waiting(self) -> int:
        """Requests queued, in a batch that is still filling, or reserved (admitted, item not yet submitted): not yet
        handed to the runtime."""
        return len(self._queue) + self._filling + self._reserved

    @property
    def running(self) -> bool:
        return self._consumer is not None and not self._consumer.done() and not self._closing

    async def start(self) -> None:
        if self._consumer is not None:
            raise RuntimeError(f"batcher {self.name} already started")
        if self._own_executor:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"vlserve-{self.name}")
        self._arrived = asyncio.Event()  # set on every arrival, on stop, and when a batch of the runtime finishes
        self._out_of_time = None
        self._in_flight.listen(self._arrived)
        self._in_flight.join(self)
        self._closing = False
        self._consumer = asyncio.create_task(self._consume(), name=f"batcher-{self.name}")

    async def stop(self, timeout_s: float | None = None) -> None:
        """Refuse new items, finish every queued one, then stop; after timeout_s the rest fail with BatcherClosedError."""
        if self._consumer is None:
            return
        self._closing = True
        self._arrived.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._consumer), timeout_s)
        except TimeoutError:
            self._consumer.cancel()
            await asyncio.gather(self._consumer, return_exceptions=True)
        finally:
            self._fail_queued(BatcherClosedError(f"batcher {self.name} stopped before this request ran"))
            self._consumer = None
            self._in_flight.unlisten(self._arrived)
            self._in_flight.leave(self)
            if self._own_executor and self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

    def close_now(self) -> int:
        """Out of time (the shutdown budget has run out): refuse new items, fail every queued request and the running
        batch's with BatcherClosedError at once, drop background items. A batch running in the executor cannot be
        interrupted: its results are dropped when it returns. stop() still ends the consumer. Returns the requests
        failed."""
        if self._consumer is None:
            return 0
        self._closing = True
        self._arrived.set()
        failed = 0
        closed = self._out_of_time = BatcherClosedError(
            f"batcher {self.name}: the shutdown timeout ran out before this request finished")
        for p in [*self._running, *self._queue, *self._bulk]:  # a batch still filling fails as it reaches _run
            if not p.future.done():
                p.future.set_exception(closed)
                failed += 1
        self._queue.clear()
        self._bulk.clear()
        while self._background:
            self._background.popleft().future.cancel()  # work no request waits for
        return failed

    def expect(self, batch_seconds: float) -> None:
        """Admit by this batch time until a batch has been measured (InFlight.expect), e.g. the time of a warm-up run:
        without it, a burst arriving before the first batch has finished would all be admitted."""
        self._in_flight.expect(batch_seconds)
        self._batch_seconds = max(self._batch_seconds, batch_seconds)

    def reserve(self) -> Reservation:
        """Admit a request now (admit(): QueueFullError when it would wait too long), before work of the caller's own
        that a refusal would waste; the reservation counts as queued until submit(item, reservation=it)."""
        self.check_open()
        self.admit()
        return Reservation(self)

    def check_open(self) -> None:
        """BatcherClosedError unless the batcher takes items."""
        if self._consumer is None or self._closing:
            raise BatcherClosedError(f"batcher {self.name} is not running")

    async def submit(self, item: T, background: bool = False, admitted: bool = False,
                     reservation: Reservation | None = None, bulk: bool = False) -> R:
        """The result of `fn` for this item, computed in some batch; a background item runs only when no request
        waits, a bulk item behind requests but in turn with them (module doc). `admitted`: the caller has asked
        admit() for the request this item belongs to (a request of several items is admitted or refused whole, never
        shed part-way by its own items queued ahead); `reservation`: the caller's reserve() (admitted then), released
        as the item is queued."""
        if reservation is not None:
            reservation.release()
            admitted = True
        self.check_open()
        if not (background or bulk or admitted):
            self.admit()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        pending = _Pending(item, future, loop.time(), background, bulk)
        if bulk:
            if not self._bulk:  # its turn comes after the next request batch, if requests keep it waiting
                self._bulk_turn_at = self._in_flight.request_batches
            self._bulk.append(pending)
        else:
            (self._background if background else self._queue).append(pending)
        self._arrived.set()
        return await future  # cancelling the caller cancels the future; the consumer then skips it

    def admit(self) -> None:
        """Raise QueueFullError when the queue is full or a new request would wait longer than max_queue_wait_ms.
        submit() asks it; a caller may ask first, before work of its own that a refusal would waste."""
        waiting = len(self._queue) + self._reserved
        if waiting >= self.config.max_queue:
            raise QueueFullError(self.name, f"queue full ({self.config.max_queue} requests waiting)", retry_after(
                waiting, self.config.max_batch_size, self._batch_seconds, self.config.max_wait_ms / 1000))
        if self.config.max_queue_wait_ms:
            queued, running = self._in_flight.expected_wait_s(self)
            if queued * 1000 > self.config.max_queue_wait_ms:
                self.shed += 1
                raise QueueFullError(self.name, f"the batches queued ahead would take {queued * 1000:.0f} ms, over "
                                     f"max_queue_wait_ms {self.config.max_queue_wait_ms:g}", queued + running)

    # --- consumer ---------------------------------------------------------------------------------

    async def _consume(self) -> None:
        while True:
            batch = await self._collect()
            if batch is None:
                return
            try:
                await self._run(batch)
            except asyncio.CancelledError:
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(BatcherClosedError(f"batcher {self.name} stopped while this request ran"))
                raise
            except Exception:  # a bug here must not kill the consumer and strand every later request
                log.exception("batcher %s: unexpected error handling a batch", self.name)
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(RuntimeError(f"batcher {self.name}: internal error"))
            del batch  # its items (decoded images, for the detector) are freed now, not when the next batch comes

    async def _collect(self) -> list[_Pending[T, R]] | None:
        """The next batch of live items, or None once closing with nothing left."""
        while True:
            self._drop_cancelled()
            quiet = self._in_flight.idle and not self._in_flight.requests_waiting  # no request would wait for it
            if self._bulk and (self._closing or quiet or self._in_flight.request_batches > self._bulk_turn_at):
                self._bulk_turn_at = self._in_flight.request_batches
                return [self._bulk.popleft() for _ in range(min(self.config.max_batch_size, len(self._bulk)))]
            if self._queue:
                break
            if self._background and (self._closing or quiet):
                return [self._background.popleft() for _ in range(min(BACKGROUND_BATCH, len(self._background)))]
            if self._closing:
                return None
            self._arrived.clear()
            await self._arrived.wait()
        batch = [self._queue.popleft()]
        try:
            return await self._fill(batch)
        finally:
            self._filling = 0

    async def _fill(self, batch: list[_Pending[T, R]]) -> list[_Pending[T, R]]:
        """Adds queued requests to the batch until it is full, the runtime is idle or the first one's deadline."""
        loop = asyncio.get_running_loop()
        self._filling = len(batch)
        deadline = batch[0].enqueued + self.config.max_wait_ms / 1000
        while len(batch) < self.config.max_batch_size:
            if self._queue:
                p = self._queue.popleft()
                if not p.future.done():
                    batch.append(p)
                    self._filling = len(batch)
                continue
            # nothing else queued: go now if the runtime is idle, else wait for an arrival, a free runtime or the deadline
            if self._closing or self._in_flight.idle or loop.time() >= deadline:
                break
            self._arrived.clear()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._arrived.wait()
            except TimeoutError:
                break
        return batch

    async def _run(self, batch: list[_Pending[T, R]]) -> None:
        loop = asyncio.get_running_loop()
        live = [p for p in batch if not p.future.done()]  # callers may have gone while the batch filled
        if self._out_of_time is not None:
            for p in live:
                p.future.set_exception(self._out_of_time)
            return
        if not live:
            return
        started = loop.time()
        max_wait = started - min(p.enqueued for p in live)
        t0 = time.perf_counter()
        self._in_flight.started()
        self._running = live
        try:
            try:
                results = await loop.run_in_executor(self._executor, self.fn, [p.item for p in live])
            except Exception as exc:
                if len(live) == 1:
                    raise
                # one bad item must not fail the others: each runs again alone
                log.warning("batcher %s: a batch of %d failed (%s: %s); running its items one at a time",
                            self.name, len(live), type(exc).__name__, exc)
                results = [None if p.future.done() else await self._alone(p.item) for p in live]
            results = check_results(results, len(live))
        except Exception as exc:
            for p in live:
                if not p.future.done():
                    p.future.set_exception(exc)
            results = None
        finally:
            self._running = []
            run_s = time.perf_counter() - t0
            # background batches are small: their time would understate what a request waits for
            self._in_flight.finished(None if live[0].background else run_s,
                                     request=not (live[0].background or live[0].bulk))
        if results is not None:
            for p, result in zip(live, results):
                if p.future.done():
                    continue
                if isinstance(result, Exception):
                    p.future.set_exception(result)
                else:
                    p.future.set_result(result)
        self.batches += 1
        self.items += len(live)
        self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * run_s
        if self.on_batch is not None:
            try:
                self.on_batch(len(live), max_wait, run_s)
            except Exception:  # metrics must never break serving
                log.exception("batcher %s: on_batch hook failed", self.name)

    async def _alone(self, item: T) -> R | Exception:
        """fn on one item: its result, or the exception it raised."""
        try:
            return check_results(await asyncio.get_running_loop().run_in_executor(self._executor, self.fn, [item]), 1)[0]
        except Exception as exc:
            return exc

    def _drop_cancelled(self) -> None:
        for queue in (self._queue, self._bulk, self._background):
            while queue and queue[0].future.done():
                queue.popleft()

    def _fail_queued(self, exc: Exception) -> None:
        for queue in (self._queue, self._bulk, self._background):
            while queue:
                p = queue.popleft()
                if not p.future.done():
                    p.future.set_exception(exc)
