"""Feature stores: in-process LRU bounded in bytes; Redis hit/miss, TTL, corrupt values, fingerprints, outages."""
import asyncio
import logging
import socket
import time

import numpy as np
import pytest

from models.region_features import RegionFeatures
from service.feature_store import (InProcessStore, RedisStore, StoreUnavailableError, TieredStore, create_store,
                                   feature_key)
from service.settings import load_settings


def run(coro):
    return asyncio.run(coro)


def regions(seed: int = 0, n: int = 8, d: int = 16) -> RegionFeatures:
    rng = np.random.default_rng(seed)
    lo = rng.uniform(0, 50, (n, 2))
    return RegionFeatures(
        boxes=np.concatenate([lo, lo + rng.uniform(1, 40, (n, 2))], 1), features=rng.standard_normal((n, d)),
        obj_ids=rng.integers(0, 3, n), obj_scores=rng.uniform(0, 1, n), attr_ids=rng.integers(0, 2, n),
        attr_scores=rng.uniform(0, 1, n), image_hw=(96, 128), num_boxes=n - 2, image_feature=rng.standard_normal(d))


def same(a: RegionFeatures, b: RegionFeatures) -> bool:
    """Equal at rest precision (safetensors metadata order varies, so bytes are not compared)."""
    a, b = a.to_float16(), b.to_float16()
    arrays = ("boxes", "features", "obj_ids", "obj_scores", "attr_ids", "attr_scores", "image_feature")
    return (a.image_hw, a.num_boxes) == (b.image_hw, b.num_boxes) and all(
        np.array_equal(getattr(a, k), getattr(b, k)) for k in arrays)


# --- in-process ------------------------------------------------------------------------------------


def test_memory_store_round_trip_and_counters():
    async def main():
        store = InProcessStore(1 << 20, "fp")
        assert await store.get("a") is None
        await store.put("a", regions(0))
        got = await store.get("a")
        return store, got

    store, got = run(main())
    assert same(got, regions(0)) and got.features.dtype == np.float16, "stored at rest precision"
    assert store.stats() == {"name": "memory", "hits": 1, "misses": 1, "errors": 0, "skipped": 0, "pool_waits": 0,
                             "available": True, "corrupt": 0, "items": 1,
                             "bytes": len(regions(0).to_bytes()), "max_bytes": 1 << 20, "evictions": 0, "too_large": 0}


def test_memory_store_is_bounded_in_bytes_and_evicts_least_recently_used():
    size = len(regions(0).to_bytes())

    async def main():
        store = InProcessStore(3 * size + size // 2)  # room for three values
        for i in range(3):
            await store.put(f"img{i}", regions(i))
        await store.get("img0")  # img0 is now the most recently used; img1 the oldest
        await store.put("img3", regions(3))
        present = [await store.get(f"img{i}") is not None for i in range(4)]
        return store, present

    store, present = run(main())
    assert present == [True, False, True, True]
    assert store.nbytes == 3 * size <= store.max_bytes and len(store) == 3 and store.evictions == 1


def test_memory_store_replaces_in_place_and_refuses_values_larger_than_its_bound():
    size = len(regions(0).to_bytes())

    async def main():
        store = InProcessStore(2 * size)
        await store.put("a", regions(0))
        await store.put("a", regions(1))
        replaced = await store.get("a")
        tiny = InProcessStore(size - 1)
        await tiny.put("a", regions(0))
        return store, replaced, tiny

    store, replaced, tiny = run(main())
    assert same(replaced, regions(1)) and store.nbytes == size and len(store) == 1
    assert len(tiny) == 0 and tiny.nbytes == 0


def test_memory_store_is_keyed_by_fingerprint():
    async def main():
        store = InProcessStore(1 << 20, "old")
        await store.put("a", regions(0))
        store.fingerprint = "new"
        return await store.get("a")

    assert run(main()) is None
    with pytest.raises(ValueError, match="max_bytes"):
        InProcessStore(0)


# --- Redis -----------------------------------------------------------------------------------------


def test_redis_hit_miss_and_ttl(redis_server, redis_url):
    async def main():
        store = RedisStore(redis_url, "fp1", ttl_s=300)
        miss = await store.get("a")
        await store.put("a", regions(0))
        hit = await store.get("a")
        await store.close()
        return store, miss, hit

    store, miss, hit = run(main())
    assert miss is None and same(hit, regions(0))
    assert (store.hits, store.misses, store.errors, store.corrupt) == (1, 1, 0, 0)
    with redis_server.client() as client:
        key = feature_key("fp1", "a")
        assert key == "vlserve:feat:fp1:a"
        assert 290 <= client.ttl(key) <= 300
        assert same(RegionFeatures.from_bytes(client.get(key)), regions(0))
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"


@pytest.mark.parametrize("value", [b"", b"garbage", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}   ",
                                   regions(0).to_bytes()[:-7], regions(0).to_bytes()[:-3] + b"\xff\xff\xff"],
                         ids=["empty", "garbage", "foreign", "truncated", "flipped"])
def test_redis_corrupt_value_is_a_miss_then_replaced(redis_server, redis_url, value):
    with redis_server.client() as client:
        client.set(feature_key("fp1", "a"), value)

    async def main():
        store = RedisStore(redis_url, "fp1", ttl_s=300)
        first = await store.get("a")
        await store.put("a", regions(1))
        second = await store.get("a")
        await store.close()
        return store, first, second

    store, first, second = run(main())
    assert first is None and same(second, regions(1))
    assert (store.hits, store.misses, store.corrupt, store.errors) == (1, 1, 1, 0)


def test_redis_new_fingerprint_never_reads_old_entries(redis_server, redis_url):
    async def main():
        old = RedisStore(redis_url, "detector-a", ttl_s=300)
        await old.put("img", regions(0))
        new = RedisStore(redis_url, "detector-b", ttl_s=300)
        seen = await new.get("img")
        await new.put("img", regions(1))
        kept = await old.get("img")
        for s in (old, new):
            await s.close()
        return seen, kept

    seen, kept = run(main())
    assert seen is None and same(kept, regions(0))
    with redis_server.client() as client:
        assert sorted(client.keys("vlserve:feat:*")) == [b"vlserve:feat:detector-a:img", b"vlserve:feat:detector-b:img"]


def test_redis_down_is_a_fast_miss_and_the_store_recovers(restartable_redis):
    server = restartable_redis

    async def main():
        store = RedisStore(server.url, "fp", ttl_s=300, backoff_s=0.3)
        await store.put("a", regions(0))
        assert await store.get("a") is not None
        server.stop()
        t0 = time.perf_counter()
        during = [await store.get("a") for _ in range(20)]
        for _ in range(5):
            await store.put("b", regions(1))  # skipped, never raises
        elapsed = time.perf_counter() - t0
        errors_during = store.errors
        assert not store.available
        server.start()  # an empty Redis (no persistence): entries come back only through put
        await asyncio.sleep(0.35)  # past the back-off
        await store.put("a", regions(2))
        after = await store.get("a")
        await store.close()
        return store, during, elapsed, errors_during, after

    store, during, elapsed, errors_during, after = run(main())
    assert during == [None] * 20
    assert elapsed < 0.5, f"25 operations against a dead Redis took {elapsed:.2f} s"
    assert 1 <= errors_during <= 3, "the back-off skips Redis instead of failing every call"
    assert store.skipped >= 20 and store.available
    assert same(after, regions(2)), "the store recovered once Redis returned"


def test_an_outage_is_logged_when_it_begins_while_it_lasts_and_when_it_ends(restartable_redis, caplog, monkeypatch):
    """A warning when Redis goes away, reminders at most every _OUTAGE_LOG_S (not one per back-off), and an INFO
    line when it answers again, so an operator can tell that it came back."""
    import service.feature_store as feature_store

    server = restartable_redis
    monkeypatch.setattr(feature_store, "_OUTAGE_LOG_S", 0.5)

    async def main():
        store = RedisStore(server.url, "fp", ttl_s=300, backoff_s=0.1)
        await store.put("a", regions(0))
        server.stop()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.2:  # 12 back-offs, each ending in a failed lookup
            await store.get("a")
            await asyncio.sleep(0.02)
        server.start()
        await asyncio.sleep(0.15)
        await store.put("a", regions(1))
        await store.get("a")
        await store.close()

    with caplog.at_level(logging.INFO, logger=feature_store.log.name):
        run(main())
    lines = [(rec.levelno, rec.getMessage()) for rec in caplog.records if rec.name == feature_store.log.name]
    assert lines[0][0] == logging.WARNING and "serving without cache, retrying every 0.1 s" in lines[0][1]
    assert 1 <= sum("still unreachable after" in msg for _, msg in lines) <= 2, lines
    assert lines[-1][0] == logging.INFO and "reachable again after" in lines[-1][1]
    assert len(lines) <= 4


def test_hung_redis_times_out_quickly_then_is_skipped(restartable_redis):
    server = restartable_redis

    async def main():
        store = RedisStore(server.url, "fp", ttl_s=300, timeout_s=0.2, backoff_s=0.5)
        await store.put("a", regions(0))
        server.pause()
        t0 = time.perf_counter()
        first = await store.get("a")  # waits for the socket timeout once
        t1 = time.perf_counter()
        rest = [await store.get("a") for _ in range(10)]  # skipped during the back-off
        await store.put("a", regions(1))
        t2 = time.perf_counter()
        server.resume()
        await asyncio.sleep(0.55)
        back = await store.get("a")
        await store.close()
        return store, first, rest, t1 - t0, t2 - t1, back

    store, first, rest, timed_out, skipped, back = run(main())
    assert first is None and rest == [None] * 10 and store.errors == 1
    assert 0.15 < timed_out < 0.6 and skipped < 0.05
    assert same(back, regions(0)), "the value written before the hang is read again"


def test_redis_unreachable_from_the_start():
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        store = RedisStore(f"redis://127.0.0.1:{port}/0", "fp", ttl_s=10)
        t0 = time.perf_counter()
        got = await store.get("a")
        await store.put("a", regions(0))
        elapsed = time.perf_counter() - t0
        up = await store.ping()
        await store.close()
        return store, got, elapsed, up

    store, got, elapsed, up = run(main())
    assert got is None and store.errors == 1 and store.skipped == 1 and elapsed < 0.6 and not up


def test_create_store_follows_settings(redis_url):
    async def main():
        redis_store = create_store(load_settings(redis_url=redis_url, redis_ttl_s=42), "fp")
        memory = create_store(load_settings(redis_url=None, cache_max_bytes=1000), "fp")
        up = await redis_store.ping()
        await redis_store.close()
        return redis_store, memory, up

    redis_store, memory, up = run(main())
    assert isinstance(redis_store, TieredStore) and up  # Redis behind the pod's local tier
    shared, local = redis_store.shared, redis_store.local
    assert isinstance(shared, RedisStore) and shared.ttl_s == 42 and shared.fingerprint == "fp"
    assert isinstance(local, InProcessStore) and local.fingerprint == "fp"
    assert isinstance(memory, InProcessStore) and memory.max_bytes == 1000 and memory.fingerprint == "fp"


def test_the_local_tier_answers_without_redis_and_fills_from_it(restartable_redis):
    async def main():
        writer = create_store(load_settings(redis_url=restartable_redis.url), "fp")
        reader = create_store(load_settings(redis_url=restartable_redis.url), "fp")
        await writer.put("a", regions(0))
        first = await reader.get("a", strict=True)  # from Redis, kept locally
        restartable_redis.stop()
        local = await reader.get("a", strict=True)  # Redis away: the local tier answers
        with pytest.raises(StoreUnavailableError):
            await reader.get("b", strict=True)  # not held locally, Redis away: not an unknown image
        stats = reader.stats()
        await writer.close()
        await reader.close()
        return first, local, stats

    first, local, stats = run(main())
    assert same(first, regions(0)) and same(local, regions(0))
    assert stats["local_hits"] == 1 and stats["hits"] == 2 and stats["errors"] == 1


def test_a_strict_lookup_says_the_store_is_down_instead_of_missing(restartable_redis):
    """An image_id lookup must not answer "unknown" while Redis cannot be asked (it would send clients re-uploading)."""
    server = restartable_redis

    async def main():
        store = RedisStore(server.url, "fp", ttl_s=300, backoff_s=0.5)
        await store.put("a", regions(0))
        assert await store.get("absent", strict=True) is None  # Redis up: a true miss stays a miss
        server.stop()
        with pytest.raises(StoreUnavailableError) as failed:  # the failing call itself
            await store.get("a", strict=True)
        with pytest.raises(StoreUnavailableError) as skipped:  # during the back-off
            await store.get("a", strict=True)
        lenient = await store.get("a")  # the inline-image path: a miss, computed without the cache
        await store.close()
        return failed.value, skipped.value, lenient

    failed, skipped, lenient = run(main())
    assert lenient is None
    assert failed.retry_after_s >= 1 and 0 < skipped.retry_after_s <= 0.5
    assert "unreachable" in str(failed) and "send the image itself" in str(failed)


def test_the_in_process_store_never_raises_on_a_strict_lookup():
    async def main():
        store = InProcessStore(1 << 20)
        return await store.get("absent", strict=True)

    assert run(main()) is None


def test_a_burst_beyond_the_pool_waits_for_connections_instead_of_failing(redis_url):
    """Far more concurrent lookups than pooled connections: every one is answered, none is an error or a back-off."""

    async def main():
        store = RedisStore(redis_url, "fp", ttl_s=300, max_connections=4, timeout_s=2.0)
        await store.put("a", regions(0))
        got = await asyncio.gather(*(store.get("a", strict=True) for _ in range(400)))
        stats = store.stats()
        await store.close()
        return got, stats

    got, stats = run(main())
    assert all(rf is not None and same(rf, regions(0)) for rf in got)
    assert stats["errors"] == 0 and stats["available"] and stats["hits"] == 400


def test_pooled_connections_broken_by_a_redis_restart_cost_no_failed_lookup(restartable_redis):
    """Redis restarts while the pool holds open connections: once it is back, the first lookups reconnect and
    answer (one retry on a fresh connection), with no error and no back-off."""
    server = restartable_redis

    async def main():
        store = RedisStore(server.url, "fp", ttl_s=300, max_connections=8)
        await asyncio.gather(*(store.put(f"k{i}", regions(i)) for i in range(8)))  # several pooled connections
        server.stop()
        server.start()  # an empty Redis: every pooled socket is now dead
        await store.put("a", regions(1))
        got = await asyncio.gather(*(store.get("a", strict=True) for _ in range(8)))
        stats = store.stats()
        await store.close()
        return got, stats

    got, stats = run(main())
    assert all(rf is not None and same(rf, regions(1)) for rf in got)
    assert stats["errors"] == 0 and stats["available"]
