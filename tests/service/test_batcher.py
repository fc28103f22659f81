"""Batcher: right result to the right caller, failures stay in their batch, no wait when the runtime is idle,
max wait while it is busy, bounded queue, drain on stop."""
import asyncio
import contextlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from service.batcher import (BACKGROUND_BATCH, Batcher, BatcherClosedError, BatcherConfig, InFlight, QueueFullError,
                             check_results, retry_after)


def run(coro):
    return asyncio.run(coro)


class Recorder:
    """A batch function that records its batch sizes; `delay` seconds per call, `fail_on` items raise."""

    def __init__(self, delay: float = 0.0, fail_on: set | None = None):
        self.delay = delay
        self.fail_on = fail_on or set()
        self.sizes: list[int] = []
        self.threads: set[str] = set()

    def __call__(self, items: list[int]) -> list[int]:
        self.sizes.append(len(items))
        self.threads.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        if self.fail_on & set(items):
            raise ValueError(f"bad item in {items}")
        return [x * 10 for x in items]


def test_results_return_to_their_callers_under_concurrency():
    fn = Recorder(delay=0.002)  # requests arriving while a batch runs form the next one
    hooks = []

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=8, max_wait_ms=2, max_queue=1000),
                    on_batch=lambda n, wait, run_s: hooks.append((n, wait, run_s)))
        await b.start()

        async def client(i: int) -> tuple[int, int]:
            await asyncio.sleep(random.random() * 0.02)  # randomized arrival
            return i, await b.submit(i)

        results = await asyncio.gather(*(client(i) for i in range(200)))
        await b.stop()
        return results, b

    random.seed(0)
    results, b = run(main())
    assert all(r == i * 10 for i, r in results)
    assert sum(fn.sizes) == 200 and max(fn.sizes) <= 8 and len(fn.sizes) < 200, "requests were batched"
    assert all(not name.startswith("MainThread") for name in fn.threads), "fn runs off the event loop thread"
    assert [n for n, _, _ in hooks] == fn.sizes and all(w >= 0 and r >= 0 for _, w, r in hooks)
    assert b.batches == len(fn.sizes) and b.items == 200


def test_exception_fails_only_its_own_item():
    """A batch that raises runs again item by item: only the bad item's request gets the error."""
    fn = Recorder(fail_on={13})

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=4, max_wait_ms=20, max_queue=100))
        await b.start()
        first = await asyncio.gather(*(b.submit(i) for i in (11, 12, 13, 14)), return_exceptions=True)
        second = await asyncio.gather(*(b.submit(i) for i in (1, 2, 3)), return_exceptions=True)
        await b.stop()
        return first, second

    first, second = run(main())
    assert fn.sizes == [4, 1, 1, 1, 1, 3]
    assert first[:2] == [110, 120] and first[3] == 140
    assert isinstance(first[2], ValueError) and str(first[2]) == "bad item in [13]"
    assert second == [10, 20, 30]


def test_exception_result_fails_only_its_item_and_wrong_count_fails_the_batch():
    def per_item(items):
        return [ValueError("odd") if x % 2 else x for x in items]

    def wrong_count(items):
        return items[:-1]

    async def main():
        a = Batcher("a", per_item, BatcherConfig(4, 20, 100))
        w = Batcher("w", wrong_count, BatcherConfig(4, 20, 100))
        await a.start()
        await w.start()
        mixed = await asyncio.gather(*(a.submit(i) for i in range(4)), return_exceptions=True)
        wrong = await asyncio.gather(*(w.submit(i) for i in range(3)), return_exceptions=True)
        after = await a.submit(2)  # both consumers survive
        await a.stop()
        await w.stop()
        return mixed, wrong, after

    mixed, wrong, after = run(main())
    assert mixed[0] == 0 and mixed[2] == 2 and isinstance(mixed[1], ValueError) and isinstance(mixed[3], ValueError)
    assert all(isinstance(r, RuntimeError) and "2 results for a batch of 3" in str(r) for r in wrong)
    assert after == 2


def test_lone_item_runs_at_once_when_the_runtime_is_idle():
    fn = Recorder()

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=4, max_wait_ms=500, max_queue=100))
        await b.start()
        t0 = time.perf_counter()
        await b.submit(1)
        lone = time.perf_counter() - t0
        t0 = time.perf_counter()
        await asyncio.gather(*(b.submit(i) for i in range(3)))  # fewer than max_batch_size, queued together
        few = time.perf_counter() - t0
        await b.stop()
        return lone, few

    lone, few = run(main())
    assert lone < 0.2 and few < 0.2, f"waited {lone:.3f} s / {few:.3f} s with an idle runtime; max_wait_ms (0.5 s) is for a busy one"
    assert fn.sizes == [1, 3], "items queued together still share a batch"


def test_items_arriving_while_a_batch_runs_form_the_next_batch():
    fn = Recorder(delay=0.15)

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=8, max_wait_ms=2000, max_queue=100))
        await b.start()
        t0 = time.perf_counter()
        first = asyncio.ensure_future(b.submit(0))
        await asyncio.sleep(0.05)  # item 0 is running
        later = await asyncio.gather(*(b.submit(i) for i in range(1, 6)))
        elapsed = time.perf_counter() - t0
        await b.stop()
        return await first, later, elapsed

    first, later, elapsed = run(main())
    assert first == 0 and later == [10, 20, 30, 40, 50]
    assert fn.sizes == [1, 5], "the five that queued behind the running batch went together"
    assert elapsed < 1.0, f"the second batch waited for max_wait_ms ({elapsed:.3f} s) instead of the runtime"


@contextlib.asynccontextmanager
async def behind_a_busy_runtime(fn: Recorder, config: BatcherConfig, busy_s: float, threads: int = 1):
    """A started batcher for `fn` that shares its runtime (executor and InFlight) with another batcher, whose
    batch keeps the runtime busy for `busy_s` from now; yields (batcher, the shared InFlight)."""
    shared, pool = InFlight(), ThreadPoolExecutor(threads)  # one thread, as the encoder's
    busy = Batcher("busy", Recorder(delay=busy_s), BatcherConfig(1, 0, 10), pool, in_flight=shared)
    b = Batcher("t", fn, config, pool, in_flight=shared)
    await busy.start()
    await b.start()
    running = asyncio.ensure_future(busy.submit(0))
    await asyncio.sleep(0.02)  # the busy batch has started
    try:
        yield b, shared
        await running
    finally:
        await b.stop()
        await busy.stop()
        pool.shutdown()


def test_full_batch_runs_at_once_while_the_runtime_is_busy():
    fn = Recorder()

    async def main():
        # two threads: the full batch can start while the other batch still runs
        async with behind_a_busy_runtime(fn, BatcherConfig(4, 5000, 100), busy_s=0.4, threads=2) as (b, _):
            t0 = time.perf_counter()
            await asyncio.gather(*(b.submit(i) for i in range(4)))
            return time.perf_counter() - t0

    full = run(main())
    assert full < 0.3 and fn.sizes == [4], f"a full batch waited {full:.3f} s"


def test_max_wait_is_honoured_while_another_batcher_keeps_the_runtime_busy():
    """Batchers sharing a runtime share its InFlight: behind another task's batch, one fills for max_wait_ms."""
    fn = Recorder()
    arrived: dict[int, float] = {}

    async def main():
        async with behind_a_busy_runtime(fn, BatcherConfig(8, 150, 100), busy_s=0.6) as (b, _):
            t0 = time.perf_counter()

            async def at(delay: float, i: int):
                await asyncio.sleep(delay)
                arrived[i] = time.perf_counter() - t0
                return await b.submit(i)

            # 1 and 2 arrive within max_wait of each other; 3 arrives after the first batch has gone
            return await asyncio.gather(at(0, 1), at(0.05, 2), at(0.35, 3))

    assert run(main()) == [10, 20, 30]
    assert arrived[2] < 0.15 < arrived[3], arrived  # the test's own timing held
    assert fn.sizes == [2, 1], "the batch left at max_wait_ms; the item that came later ran in the next one"


def test_filling_batch_goes_as_soon_as_the_runtime_is_idle():
    fn = Recorder()

    async def main():
        async with behind_a_busy_runtime(fn, BatcherConfig(8, 5000, 100), busy_s=0.2) as (b, shared):
            t0 = time.perf_counter()
            out = await asyncio.gather(b.submit(1), b.submit(2))
            return out, time.perf_counter() - t0, shared

    out, waited, shared = run(main())
    assert out == [10, 20] and fn.sizes == [2] and shared.count == 0
    assert waited < 1.0, f"waited {waited:.3f} s: the batch should leave when the other batch finished (~0.2 s)"


def test_zero_wait_runs_whatever_is_queued():
    fn = Recorder()

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=16, max_wait_ms=0, max_queue=100))
        await b.start()
        out = await asyncio.gather(*(b.submit(i) for i in range(10)))
        await b.stop()
        return out

    assert run(main()) == [i * 10 for i in range(10)]
    assert fn.sizes == [10], "items queued in the same loop iteration share a batch"


def test_full_queue_raises_queue_full_with_retry_after():
    fn = Recorder(delay=0.2)

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=1, max_wait_ms=0, max_queue=3))
        await b.start()
        running = asyncio.ensure_future(b.submit(0))
        await asyncio.sleep(0.05)  # item 0 is running; the queue is empty again
        queued = [asyncio.ensure_future(b.submit(i)) for i in (1, 2, 3)]
        await asyncio.sleep(0)
        assert b.queue_depth == 3
        with pytest.raises(QueueFullError) as err:
            await b.submit(4)
        results = await asyncio.gather(running, *queued)
        await b.stop()
        return err.value, results

    err, results = run(main())
    assert err.retry_after_s > 0 and "queue full" in str(err)
    assert results == [0, 10, 20, 30]


def test_stop_drains_queued_work_then_refuses():
    fn = Recorder(delay=0.02)

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=2, max_wait_ms=50, max_queue=100))
        await b.start()
        pending = [asyncio.ensure_future(b.submit(i)) for i in range(7)]
        await asyncio.sleep(0)
        await b.stop()
        assert all(p.done() for p in pending)
        with pytest.raises(BatcherClosedError):
            await b.submit(1)
        return [p.result() for p in pending]

    assert run(main()) == [i * 10 for i in range(7)]
    assert fn.sizes == [2, 2, 2, 1]


def test_stop_timeout_fails_the_rest():
    fn = Recorder(delay=0.3)

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=1, max_wait_ms=0, max_queue=100))
        await b.start()
        pending = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        await b.stop(timeout_s=0.05)
        return await asyncio.gather(*pending, return_exceptions=True)

    assert all(isinstance(r, BatcherClosedError) for r in run(main()))


def test_cancelled_callers_do_not_break_the_consumer():
    fn = Recorder(delay=0.05)

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=4, max_wait_ms=10, max_queue=100))
        await b.start()
        running = [asyncio.ensure_future(b.submit(i)) for i in range(4)]  # first batch
        await asyncio.sleep(0.02)
        queued = [asyncio.ensure_future(b.submit(i)) for i in range(4, 8)]  # waits behind it
        await asyncio.sleep(0)
        running[0].cancel()  # cancelled while its batch runs
        for q in queued[:3]:
            q.cancel()  # cancelled while queued: never run
        later = await b.submit(9)
        rest = await asyncio.gather(*running[1:], queued[3])
        await b.stop()
        return later, rest

    later, rest = run(main())
    assert later == 90 and rest == [10, 20, 30, 70]
    assert sum(fn.sizes) == 4 + 2, "cancelled queued items were dropped, not run"


def test_submit_before_start_and_bad_config():
    async def main():
        b = Batcher("t", Recorder(), BatcherConfig(1, 0, 1))
        with pytest.raises(BatcherClosedError):
            await b.submit(1)

    run(main())
    for bad in (dict(max_batch_size=0), dict(max_wait_ms=-1), dict(max_wait_ms=float("nan")), dict(max_queue=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BatcherConfig(**{**dict(max_batch_size=1, max_wait_ms=0, max_queue=1), **bad})


def test_pure_helpers():
    assert retry_after(queue_depth=63, max_batch_size=32, batch_seconds=0.5, max_wait_s=0.005) == 1.0
    assert retry_after(0, 32, 0.0, 0.0) > 0
    assert check_results((1, 2), 2) == [1, 2]
    assert [r.tolist() for r in check_results(np.eye(2), 2)] == [[1, 0], [0, 1]]
    with pytest.raises(RuntimeError, match="returned dict"):
        check_results({"a": 1}, 1)
    with pytest.raises(RuntimeError, match="returned int"):
        check_results(3, 1)
    with pytest.raises(RuntimeError, match="1 results for a batch of 2"):
        check_results([1], 2)


class Order(Recorder):
    """A Recorder that also records which items each batch held."""

    def __init__(self, delay: float = 0.0):
        super().__init__(delay)
        self.batches: list[list[int]] = []

    def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        return super().__call__(items)


def test_background_work_runs_in_small_batches_and_never_ahead_of_a_request():
    fn = Order(delay=0.03)

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=32, max_wait_ms=0, max_queue=4))
        await b.start()
        background = [asyncio.ensure_future(b.submit(100 + i, background=True)) for i in range(40)]  # past max_queue
        await asyncio.sleep(0.045)  # a background batch is running
        started_before = len(fn.batches)
        request = await b.submit(1)
        rest = await asyncio.gather(*background)
        await b.stop()
        return request, started_before, rest

    request, started_before, rest = run(main())
    assert request == 10 and rest == [10 * (100 + i) for i in range(40)]
    assert all(len(batch) <= BACKGROUND_BATCH for batch in fn.batches if batch[0] >= 100)
    assert 1 <= started_before < 5  # the test's own timing held: background batches were under way
    # the next batch after the request arrived was the request's: it waited for the running batch only
    assert fn.batches.index([1]) == started_before, fn.batches


def test_background_work_waits_while_another_batcher_has_requests_queued():
    """Two batchers share a runtime: one batcher's background work does not start while the other's request waits."""
    requests, background = Order(delay=0.05), Order(delay=0.05)
    order: list[str] = []

    async def main():
        shared, pool = InFlight(), ThreadPoolExecutor(1)
        a = Batcher("a", requests, BatcherConfig(1, 0, 100), pool, in_flight=shared)
        bg = Batcher("bg", background, BatcherConfig(32, 0, 100), pool, in_flight=shared)
        await a.start()
        await bg.start()

        async def request(i):
            await a.submit(i)
            order.append(f"r{i}")

        async def later(i):
            await bg.submit(i, background=True)
            order.append(f"b{i}")

        first = asyncio.ensure_future(request(0))
        await asyncio.sleep(0.01)  # request 0 runs; three more requests and the background work queue behind it
        await asyncio.gather(*(request(i) for i in (1, 2, 3)), later(9))
        await first
        for b in (a, bg):
            await b.stop()
        pool.shutdown()

    run(main())
    assert order == ["r0", "r1", "r2", "r3", "b9"], order


def test_stop_runs_the_background_work_left():
    fn = Order()

    async def main():
        b = Batcher("t", fn, BatcherConfig(4, 0, 10))
        await b.start()
        pending = [asyncio.ensure_future(b.submit(i, background=True)) for i in range(10)]
        await asyncio.sleep(0)
        await b.stop()
        return await asyncio.gather(*pending, return_exceptions=True)

    assert run(main()) == [10 * i for i in range(10)]


def test_requests_that_would_wait_too_long_are_refused_at_once():
    """Shedding by expected wait: with 50 ms batches of 2 and a 120 ms budget, a burst of 20 keeps those that fit in
    the batches queued within the budget (2 batches ahead, then the one they join: about 6); the rest are refused at
    submit with a Retry-After of their expected wait, long before max_queue."""
    fn = Recorder(delay=0.05)
    waited: list[float] = []

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=2, max_wait_ms=0, max_queue=1000, max_queue_wait_ms=120))
        await b.start()
        await b.submit(0)  # one batch measured: the estimate has a basis

        async def one(i):
            t0 = time.perf_counter()
            try:
                await b.submit(i)
            except QueueFullError as exc:
                return exc
            waited.append(time.perf_counter() - t0)
            return None

        outcomes = await asyncio.gather(*(one(i) for i in range(1, 21)))
        await b.stop()
        return outcomes, b.shed

    outcomes, shed = run(main())
    refused = [o for o in outcomes if o is not None]
    assert 12 <= len(refused) <= 16 and shed == len(refused), len(refused)
    assert all(0.1 < o.retry_after_s < 0.5 and "queued ahead" in str(o) for o in refused)
    # accepted: waited for at most the budget's batches and the one that was running, then ran their own
    assert max(waited) < 0.12 + 0.05 + 0.05 + 0.05, waited


def test_a_request_that_can_join_the_next_batch_is_always_taken():
    """However long a batch takes, a request that fits in the next batch is not refused (the running batch's time
    is not a queue it could avoid)."""
    fn = Recorder(delay=0.3)

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=8, max_wait_ms=0, max_queue=100, max_queue_wait_ms=10))
        await b.start()
        await b.submit(0)  # a 300 ms batch time measured
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0.01)  # item 1's batch is running
        joined = await asyncio.gather(*(b.submit(i) for i in range(2, 10)))  # 8 fit in the next batch
        await first
        try:
            await asyncio.gather(*(b.submit(i) for i in range(10, 27)))  # 17: the last ones are 2 batches behind
        except QueueFullError as exc:
            refused = exc
        else:
            refused = None
        await b.stop()
        return joined, refused

    joined, refused = run(main())
    assert joined == [10 * i for i in range(2, 10)]
    assert isinstance(refused, QueueFullError)


def test_expected_wait_counts_every_batcher_on_the_runtime_and_starts_unbounded():
    shared = InFlight()
    assert shared.expected_wait_s() == (0.0, 0.0)  # nothing measured yet: never refuse at start-up
    shared.started()
    shared.finished(0.1)
    assert shared.expected_wait_s() == (0.0, 0.0)  # idle, nothing queued


def test_max_queue_wait_must_be_non_negative():
    with pytest.raises(ValueError, match="max_queue_wait_ms"):
        BatcherConfig(max_batch_size=1, max_wait_ms=0, max_queue=1, max_queue_wait_ms=-1)


def test_a_lone_request_of_another_task_is_not_a_whole_batch_ahead():
    """Two task batchers on one runtime with a 300 ms batch time and a 50 ms budget: a request of one task that
    finds a single request of the other task queued is taken (that is a short batch ahead, 1/32 of a batch time, not
    a full one; the budget leaves room for a batch time measured long on a loaded machine)."""
    fn = Recorder(delay=0.3)

    async def main():
        shared, pool = InFlight(), ThreadPoolExecutor(1)
        config = BatcherConfig(max_batch_size=32, max_wait_ms=0, max_queue=100, max_queue_wait_ms=50)
        a, b = (Batcher(name, fn, config, pool, in_flight=shared) for name in ("a", "b"))
        await a.start()
        await b.start()
        await a.submit(0)  # a batch time measured
        running = asyncio.ensure_future(a.submit(1))
        await asyncio.sleep(0.01)  # a's batch runs
        queued = asyncio.ensure_future(a.submit(2))  # one request of task a waits
        await asyncio.sleep(0.01)
        other = await b.submit(3)  # not refused
        await asyncio.gather(running, queued)
        for x in (a, b):
            await x.stop()
        pool.shutdown()
        return other

    assert run(main()) == 30


def test_the_default_settings_take_a_request_only_while_it_can_join_the_next_batch():
    """With the service's defaults and the demo encoder's batch time (about 12 ms for 8 rows on a CPU core pair), a
    request that would queue behind a full batch is refused, so an accepted request waits for at most the batch
    running and its own (docs/RELIABILITY.md, Overload)."""
    from service.settings import Settings

    defaults = Settings()
    fn = Recorder(delay=0.012)

    async def main():
        config = BatcherConfig(defaults.max_batch_size, defaults.max_wait_ms, defaults.max_queue,
                               defaults.max_queue_wait_ms)
        b = Batcher("t", fn, config)
        await b.start()
        await b.submit(0)  # a batch time measured
        running = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0.004)  # item 1's batch runs
        nxt = [asyncio.ensure_future(b.submit(i)) for i in range(2, 2 + config.max_batch_size)]  # the next batch, full
        await asyncio.sleep(0)
        try:
            await b.submit(99)
        except QueueFullError as exc:
            refused = exc
        else:
            refused = None
        await asyncio.gather(running, *nxt)
        await b.stop()
        return refused

    refused = run(main())
    assert isinstance(refused, QueueFullError) and "queued ahead" in str(refused)


def test_a_request_of_many_items_is_admitted_whole():
    """A retrieval request's candidates are items of one request: admitted once, none of them is refused because
    the request's own earlier items fill the batches ahead, however long those take."""
    fn = Recorder(delay=0.02)

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=2, max_wait_ms=0, max_queue=100, max_queue_wait_ms=5))
        await b.start()
        await b.submit(0)  # a 20 ms batch time measured: a second item queued behind a full batch would be shed
        b.admit()
        results = await asyncio.gather(*(b.submit(i, admitted=True) for i in range(1, 11)))
        await b.stop()
        return results, b.shed

    results, shed = run(main())
    assert results == [10 * i for i in range(1, 11)] and shed == 0


class Held:
    """A batch function that blocks until released (the tests' stand-in for a detector image taking seconds)."""

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls: list[list[int]] = []

    def __call__(self, items: list[int]) -> list[int]:
        self.calls.append(list(items))
        self.entered.set()
        self.release.wait(30)
        return [x * 10 for x in items]


def test_close_now_fails_queued_and_running_requests_at_once():
    """The shutdown budget has run out: the requests of the batch running in the executor (which cannot be
    interrupted) and the queued ones fail with BatcherClosedError at once, background work is dropped, nothing
    queued runs afterwards, and stop() does not wait for the running batch."""
    fn = Held()

    async def main():
        b = Batcher("t", fn, BatcherConfig(max_batch_size=1, max_wait_ms=0, max_queue=100))
        await b.start()
        pending = [asyncio.ensure_future(b.submit(i)) for i in range(4)]
        background = asyncio.ensure_future(b.submit(9, background=True))
        while not fn.entered.is_set():
            await asyncio.sleep(0.005)
        assert b.close_now() == 4  # item 0 running, 1-3 queued
        outcomes = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 1)
        with pytest.raises(BatcherClosedError):
            await b.submit(5)
        with pytest.raises(BatcherClosedError):
            b.reserve()
        t0 = time.perf_counter()
        await b.stop(timeout_s=0)
        stopped_s = time.perf_counter() - t0
        fn.release.set()
        await asyncio.sleep(0.05)
        return outcomes, background.cancelled(), stopped_s

    try:
        outcomes, dropped, stopped_s = run(main())
    finally:
        fn.release.set()
    assert all(isinstance(o, BatcherClosedError) and "shutdown timeout" in str(o) for o in outcomes), outcomes
    assert dropped and stopped_s < 0.5 and fn.calls == [[0]]


def test_close_now_fails_a_batch_that_is_still_filling():
    """A batch collecting items while the runtime is busy is failed, not run, when the budget runs out."""
    fn = Held()
    shared = InFlight()

    async def main():
        busy = Batcher("other", fn, BatcherConfig(1, 0, 100), in_flight=shared)
        b = Batcher("t", Recorder(), BatcherConfig(max_batch_size=4, max_wait_ms=10_000, max_queue=100),
                    in_flight=shared)
        await busy.start()
        await b.start()
        hold = asyncio.ensure_future(busy.submit(1))
        while not fn.entered.is_set():
            await asyncio.sleep(0.005)
        filling = asyncio.ensure_future(b.submit(2))  # waits to fill while the runtime is busy
        await asyncio.sleep(0.05)
        b.close_now()
        outcome = await asyncio.wait_for(asyncio.gather(filling, return_exceptions=True), 1)
        fn.release.set()
        await hold
        await b.stop(0)
        await busy.stop(0)
        return outcome[0], b.batches

    try:
        outcome, batches = run(main())
    finally:
        fn.release.set()
    assert isinstance(outcome, BatcherClosedError) and batches == 0


def test_a_reservation_counts_as_queued_until_its_item_is_submitted():
    """Work a caller does between admission and submit (the detector's: decoding the image) is not invisible: a
    request admitted meanwhile sees the reservations ahead of it, by an expected batch time (expect()) before any
    batch has been measured; max_queue counts them too; the first measured batch replaces the estimate."""

    async def main():
        b = Batcher("t", Recorder(), BatcherConfig(max_batch_size=1, max_wait_ms=0, max_queue=3, max_queue_wait_ms=100))
        await b.start()
        b.expect(0.06)  # e.g. timed at warm-up
        first, second = b.reserve(), b.reserve()  # 0, then 60 ms ahead
        assert b.requests_waiting == 2
        with pytest.raises(QueueFullError) as refused:
            b.reserve()  # 120 ms ahead
        assert 0.1 < refused.value.retry_after_s < 0.2 and b.shed == 1
        first.release()
        first.release()  # idempotent
        third = b.reserve()
        assert await b.submit(4, reservation=second) == 40  # admitted by its reservation, released as it queued
        assert b.requests_waiting == 1
        estimate = b._in_flight.batch_seconds
        third.release()
        b.expect(5.0)  # measured now: an estimate no longer applies
        measured = b._in_flight.batch_seconds
        small = Batcher("s", Recorder(), BatcherConfig(max_batch_size=1, max_wait_ms=0, max_queue=2))
        await small.start()
        held = [small.reserve(), small.reserve()]
        with pytest.raises(QueueFullError, match="queue full"):
            await small.submit(1)
        for r in held:
            r.release()
        await small.stop()
        await b.stop()
        return estimate, measured

    estimate, measured = run(main())
    assert estimate < 0.06 and measured == estimate, "the measured batch replaced the estimate, not averaged with it"


def test_expect_is_only_an_estimate_until_a_batch_is_measured():
    shared = InFlight()
    shared.expect(5.0)
    shared.expect(3.0)
    assert shared.batch_seconds == 3.0
    shared.started()
    shared.finished(0.1)
    assert shared.batch_seconds == 0.1
    shared.expect(5.0)
    shared.started()
    shared.finished(0.2)
    assert shared.batch_seconds == pytest.approx(0.8 * 0.1 + 0.2 * 0.2)
