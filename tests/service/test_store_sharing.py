"""The shared feature store as pods share it: entries refreshed by use and written back when Redis lost them,
registration that fails when Redis cannot take the image, batched id lookups, foreign values, start-up checks."""
import asyncio
import logging
import os
import socket
import subprocess
import time

import pytest
import redis
from fastapi.testclient import TestClient
from pydantic import ValidationError
from typer.testing import CliRunner

from service.app import StartupError, create_app
from service.batcher import BatcherConfig
from service.feature_store import (InProcessStore, RedisStore, StoreConfigError, StoreUnavailableError, TieredStore,
                                   feature_key)
from service.regions import RegionService, UnknownImageError, image_id_of
from service.settings import REDIS_MAX_TTL_S, load_settings, settings_error_message
from vlserve.cli import app as cli

from tests.service.conftest import assert_problem
from tests.service.test_feature_store import regions, same


def run(coro):
    return asyncio.run(coro)


def tiered(url: str, ttl_s: int = 300, refresh_s: float | None = None, **kw) -> TieredStore:
    return TieredStore(InProcessStore(1 << 20, "fp"), RedisStore(url, "fp", ttl_s, refresh_s=refresh_s, **kw))


async def settled(store: TieredStore | RedisStore) -> None:
    """Wait for the background refreshes scheduled so far."""
    shared = store.shared if isinstance(store, TieredStore) else store
    if shared._refresher is not None:
        await shared._refresher


# --- an entry lives while any pod uses it ----------------------------------------------------------


def test_a_local_hit_writes_back_an_entry_redis_lost(redis_server, redis_url):
    """A pod answering from its local tier after Redis lost the entry (expired, evicted, flushed) puts it back, so the
    other pods can read the id again."""

    async def main():
        pod = tiered(redis_url, refresh_s=0.0)  # as refresh_s after the last refresh
        await pod.put("a", regions(0))
        with redis_server.client() as client:
            client.flushall()
        got = await pod.get("a", strict=True)  # the local tier answers
        await settled(pod)
        other = RedisStore(redis_url, "fp", 300)
        seen = await other.get("a", strict=True)
        stats = pod.stats()
        for s in (pod, other):
            await s.close()
        return got, seen, stats

    got, seen, stats = run(main())
    assert same(got, regions(0)) and seen is not None and same(seen, regions(0))
    assert stats["restored"] == 1
    with redis_server.client() as client:
        assert 290 <= client.ttl(feature_key("fp", "a")) <= 300


def test_use_refreshes_ttl_and_recency_at_most_once_per_interval(redis_server, redis_url):
    key = feature_key("fp", "a")

    async def main():
        pod = tiered(redis_url, ttl_s=300, refresh_s=60)
        await pod.put("a", regions(0))  # the TTL is fresh: no refresh for refresh_s
        with redis_server.client() as client:
            client.expire(key, 50)
            await pod.get("a")
            await settled(pod)
            kept = client.ttl(key)
            pod.shared._fresh.clear()  # as refresh_s later
            await asyncio.sleep(1.1)  # OBJECT IDLETIME counts seconds
            idle_before = client.object("idletime", key)
            await pod.get("a")
            await settled(pod)
            refreshed, idle_after = client.ttl(key), client.object("idletime", key)
        await pod.close()
        return kept, refreshed, idle_before, idle_after

    kept, refreshed, idle_before, idle_after = run(main())
    assert kept <= 50, "within refresh_s of the last refresh a local hit costs no round trip"
    assert refreshed >= 290 and idle_before >= 1 and idle_after == 0, "a use refreshes TTL and LRU recency"


# --- registration leaves the image in the shared store ----------------------------------------------


def test_share_writes_back_and_refuses_when_redis_cannot_take_the_image(redis_server, redis_url):
    async def main():
        pod = tiered(redis_url)
        await pod.put("a", regions(0))
        with redis_server.client() as client:
            client.flushall()
            await pod.share("a", regions(0))  # the local copy goes back to Redis
            back = bool(client.exists(feature_key("fp", "a")))
            client.flushall()
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 1)
            try:
                with pytest.raises(StoreUnavailableError) as refused:
                    await pod.share("a", regions(0))
            finally:
                client.config_set("maxmemory", "64mb")
                client.config_set("maxmemory-policy", "allkeys-lru")
        await pod.close()
        return back, refused.value

    back, refused = run(main())
    assert back and refused.retry_after_s >= 1 and "could not be written" in str(refused)


def regions_service(tiny_detector, store) -> RegionService:
    return RegionService(tiny_detector.detector, tiny_detector.fingerprint, store, BatcherConfig(8, 2.0, 64), 10**7)


def test_registering_with_redis_hung_fails_but_an_inline_image_is_served(tiny_detector, restartable_redis, make_png):
    async def main():
        store = tiered(restartable_redis.url, timeout_s=0.2)
        service = regions_service(tiny_detector, store)
        store.local.fingerprint = store.shared.fingerprint = tiny_detector.fingerprint
        await service.start()
        restartable_redis.pause()
        try:
            _, inline, _ = await service.from_bytes(make_png(1))  # served without the cache
            with pytest.raises(StoreUnavailableError) as refused:
                await service.from_bytes(make_png(2), register=True)
        finally:
            restartable_redis.resume()
        await service.stop()
        await store.close()
        return inline, refused.value

    inline, refused = run(main())
    assert inline.num_boxes >= 0 and refused.retry_after_s > 0


# --- ids looked up in one batch ----------------------------------------------------------------------


def test_ids_are_looked_up_in_one_round_trip_and_the_first_unknown_fails(tiny_detector, redis_server, redis_url):
    ids = [f"{i:064x}" for i in range(100)]

    async def main():
        store = tiered(redis_url)
        store.local.fingerprint = store.shared.fingerprint = tiny_detector.fingerprint
        for i, image_id in enumerate(ids):
            await store.shared.put(image_id, regions(i % 3))
        await store.put(ids[0], regions(0))  # in the local tier too
        service = regions_service(tiny_detector, store)
        with redis_server.client() as client:
            client.config_resetstat()
            got = await service.from_ids([*ids, ids[5]])
            calls = {k: v["calls"] for k, v in client.info("commandstats").items() if k in ("cmdstat_get", "cmdstat_mget")}
        with pytest.raises(UnknownImageError) as unknown:
            await service.from_ids([ids[1], "e" * 64, "f" * 64])
        await store.close()
        return got, calls, unknown.value

    got, calls, unknown = run(main())
    assert len(got) == 101 and same(got[1], regions(1)) and same(got[-1], regions(5 % 3))
    assert calls == {"cmdstat_mget": 1}, calls
    assert unknown.image_id == "e" * 64


def test_many_batched_lookups_on_a_small_pool_wait_rather_than_fail(tiny_detector, redis_url):
    """64 concurrent lookups of 100 ids each through a pool of 4 connections: every one is answered."""
    ids = [f"{i:064x}" for i in range(100)]

    async def main():
        store = RedisStore(redis_url, tiny_detector.fingerprint, 300, max_connections=4)
        for image_id in ids:
            await store.put(image_id, regions(0))
        service = regions_service(tiny_detector, store)
        got = await asyncio.gather(*(service.from_ids(ids) for _ in range(64)), return_exceptions=True)
        stats = store.stats()
        await store.close()
        return got, stats

    got, stats = run(main())
    assert not [g for g in got if isinstance(g, BaseException)] and stats["errors"] == 0 and stats["pool_waits"] == 0


# --- values that are not ours ------------------------------------------------------------------------


def test_another_redis_type_under_the_key_is_a_corrupt_miss(redis_server, redis_url):
    with redis_server.client() as client:
        client.rpush(feature_key("fp", "a"), "x")

    async def main():
        store = RedisStore(redis_url, "fp", 300)
        first = await store.get("a", strict=True)
        await store.put("a", regions(0))
        second = await store.get("a", strict=True)
        await store.close()
        return store, first, second

    store, first, second = run(main())
    assert first is None and same(second, regions(0))
    assert (store.corrupt, store.errors, store.available) == (1, 0, True)


def test_features_of_another_width_are_a_corrupt_miss(redis_url):
    async def main():
        store = RedisStore(redis_url, "fp", 300, feature_dim=16)
        await store.put("narrow", regions(0, d=8))
        await store.put("right", regions(1, d=16))
        got = [await store.get("narrow"), await store.get("right")]
        await store.close()
        return store, got

    store, (narrow, right) = run(main())
    assert narrow is None and same(right, regions(1, d=16)) and store.corrupt == 1


# --- start-up ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_up_check(url: str) -> str | None:
    """RedisStore.check at start-up: the StoreConfigError's message when it refuses, else None."""
    async def main():
        store = RedisStore(url, "fp", 300)
        try:
            await store.check()
        except StoreConfigError as exc:
            return str(exc)
        finally:
            await store.close()
        return None

    return run(main())


@pytest.mark.parametrize("url, words", [
    ("redis://nobody:s3cretpw@127.0.0.1:{port}/0", "refuses this client"),
    ("redis://127.0.0.1:{port}/99", "DB index is out of range"),
    ("rediss://:s3cretpw@127.0.0.1:{port}/0", "speaks plain Redis"),
], ids=["password", "db", "tls"])
def test_a_redis_refusing_this_client_for_good_stops_start_up(redis_server, url, words):
    message = start_up_check(url.format(port=redis_server.port))
    assert message is not None and words in message and "s3cretpw" not in message and "VLSERVE_REDIS_URL" in message


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of the test's own, started with the given options: its port."""
    procs = []

    def start(*options: str) -> int:
        port = free_port()
        procs.append(subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir",
                                       str(tmp_path), "--appendonly", "no", *options],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for _ in range(100):
            try:
                with redis.Redis(port=port, single_connection_client=True, socket_timeout=1) as client:
                    client.ping()
                return port
            except (redis.AuthenticationError, redis.ResponseError):  # it answers: with a refusal (--requirepass)
                return port
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_redis_that_cannot_persist_at_start_up_is_a_warning_not_a_refusal(own_redis, tmp_path, caplog):
    """MISCONF (its disk full or unwritable: every write and PING refused) is the server's passing state; a pod that
    restarted meanwhile stopped at start-up, exit 2, while the pods already running served on."""
    port = own_redis("--save", "3600 1", "--dbfilename", "dump.rdb")
    (tmp_path / "dump.rdb").mkdir()  # the snapshot cannot be written
    client = redis.Redis(port=port)
    client.bgsave()
    while client.info("persistence")["rdb_bgsave_in_progress"]:
        time.sleep(0.05)
    with pytest.raises(redis.ResponseError, match="MISCONF"):
        client.ping()

    with caplog.at_level(logging.WARNING, logger="vlserve.feature_store"):
        assert start_up_check(f"redis://127.0.0.1:{port}/0") is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable at start-up" in warnings[0] and "MISCONF" in warnings[0]


def test_a_password_the_url_lacks_is_said(own_redis):
    message = start_up_check(f"redis://127.0.0.1:{own_redis('--requirepass', 's3cretpw')}/0")
    assert message is not None and "refuses this client" in message and "the URL gives no password" in message


def test_a_redis_at_its_maxclients_is_busy_not_down(own_redis, caplog):
    """Redis refusing a connection for its maxclients (pods x VLSERVE_REDIS_MAX_CONNECTIONS over a small plan's
    limit) is a busy store: the lookup that found no connection answers 503 busy, and the next one is tried at once
    rather than after a second's back-off as for a Redis that is down."""
    port = own_redis("--maxclients", "1")
    held = redis.Redis(port=port, single_connection_client=True)
    for _ in range(50):  # the one connection Redis allows, once the start-up check's has closed
        try:
            held.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)

    async def main():
        store = RedisStore(f"redis://127.0.0.1:{port}/0", "fp", 300)
        with pytest.raises(StoreUnavailableError, match="busy") as refused:
            await store.get("a" * 64, strict=True)
        available = store.available
        held.close()
        await asyncio.sleep(0.2)  # Redis notices the closed connection
        found = await store.get("a" * 64, strict=True)
        await store.close()
        return refused.value, available, found, store.stats()

    with caplog.at_level(logging.WARNING, logger="vlserve.feature_store"):
        refused, available, found, stats = run(main())
    assert available and found is None and stats["pool_waits"] == 1 and refused.retry_after_s == 1.0
    assert [r.getMessage() for r in caplog.records if "maxclients" in r.getMessage()]


def test_redis_refusing_writes_is_logged_once_a_while_not_per_write(redis_server, redis_url, caplog):
    """Out of memory under noeviction, every registration's write and share failed with a warning each: 408 lines for
    300 registrations. The first is said, then one a while with how many followed."""
    async def main():
        store = RedisStore(redis_url, "fp", 300)
        with redis_server.client() as client:
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 1)
            try:
                for i in range(20):
                    await store.put(f"{i:064x}", regions(i))
            finally:
                client.config_set("maxmemory", "64mb")
                client.config_set("maxmemory-policy", "allkeys-lru")
        await store.close()
        return store.stats()

    with caplog.at_level(logging.WARNING, logger="vlserve.feature_store"):
        stats = run(main())
    refused = [r.getMessage() for r in caplog.records if "OutOfMemoryError" in r.getMessage()]
    assert stats["errors"] == 20 and len(refused) == 1 and "logged at most every 30 s" in refused[0]


def test_an_unreachable_redis_at_start_up_is_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="vlserve.feature_store"):
        assert start_up_check(f"redis://:s3cretpw@127.0.0.1:{free_port()}/0") is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable at start-up" in warnings[0] and "s3cretpw" not in warnings[0]


def test_the_app_does_not_start_with_a_wrong_password(redis_server, make_settings):
    app = create_app(make_settings(redis_url=f"redis://nobody:s3cretpw@127.0.0.1:{redis_server.port}/0"))
    with pytest.raises(StartupError, match="refuses this client"):
        with TestClient(app):
            pass
    assert "s3cretpw" not in app.state.startup_error and "127.0.0.1" in app.state.startup_error


def test_serve_exits_2_on_a_wrong_db_index(monkeypatch, redis_server, tiny_checkpoint, tiny_detector):
    for name in list(os.environ):
        if name.startswith("VLSERVE_"):
            monkeypatch.delenv(name)
    result = CliRunner().invoke(cli, ["serve", "--model-dir", str(tiny_checkpoint), "--detector-dir",
                                      str(tiny_detector.dir), "--port", "0", "--log-level", "critical", "--redis-url",
                                      f"redis://127.0.0.1:{redis_server.port}/99"])
    assert result.exit_code == 2 and "DB index is out of range" in result.output and "Traceback" not in result.output


# --- settings ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://:s3cretpw@redis:6379/0", "redis://:s3cretpw@127.0.0.1:notaport/0",
                                 "redis://127.0.0.1:99999/0", "redis://[::1/0", "redis://h/0?socket_timeout=abc",
                                 "redis://h/abc", "redis://h/0?password=s3cretpw&socket_timeout=abc"])
def test_malformed_redis_urls_are_invalid_settings_without_their_password(url):
    with pytest.raises(ValidationError) as err:
        load_settings(redis_url=url)
    message = settings_error_message(err.value)
    assert message.startswith("invalid settings: VLSERVE_REDIS_URL") and "\n" not in message
    assert "s3cretpw" not in message


def test_serve_exits_2_on_a_malformed_redis_url(monkeypatch, tiny_checkpoint, tiny_detector):
    for name in list(os.environ):
        if name.startswith("VLSERVE_"):
            monkeypatch.delenv(name)
    result = CliRunner().invoke(cli, ["serve", "--model-dir", str(tiny_checkpoint), "--detector-dir",
                                      str(tiny_detector.dir), "--redis-url", "redis://:s3cretpw@127.0.0.1:notaport/0"])
    assert result.exit_code == 2 and "invalid settings" in result.output and "s3cretpw" not in result.output


def test_ttl_bound_is_one_redis_accepts(redis_server, redis_url):
    assert load_settings(redis_ttl_s=REDIS_MAX_TTL_S).redis_ttl_s == REDIS_MAX_TTL_S
    with pytest.raises(ValidationError, match="less than or equal to"):
        load_settings(redis_ttl_s=REDIS_MAX_TTL_S + 1)
    with redis_server.client() as client:
        assert client.set("k", b"v", ex=REDIS_MAX_TTL_S) and client.expire("k", REDIS_MAX_TTL_S)


def test_cache_max_bytes_0_means_redis_without_a_local_tier(redis_url):
    from service.feature_store import create_store

    store = create_store(load_settings(redis_url=redis_url, cache_max_bytes=0), "fp")
    assert isinstance(store, RedisStore)
    run(store.close())
    with pytest.raises(ValidationError, match="only with VLSERVE_REDIS_URL"):
        load_settings(redis_url=None, cache_max_bytes=0)


def test_a_value_larger_than_the_local_tier_is_logged_once_and_counted(caplog):
    async def main():
        store = InProcessStore(100, "fp")
        for i in range(5):
            await store.put(f"a{i}", regions(i))
        return store

    with caplog.at_level(logging.DEBUG, logger="vlserve.feature_store"):
        store = run(main())
    assert store.stats()["too_large"] == 5
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


# --- end to end --------------------------------------------------------------------------------------


def test_post_images_answers_503_when_redis_cannot_take_the_image(make_settings, restartable_redis, make_png):
    import base64

    with TestClient(create_app(make_settings(redis_url=restartable_redis.url))) as client:
        data = make_png(71)
        assert client.post("/images", json={"image": base64.b64encode(data).decode()}).status_code == 200
        with restartable_redis.client() as r:
            r.flushall()
        again = client.post("/images", json={"image": base64.b64encode(data).decode()})  # answered from the local tier
        with restartable_redis.client() as r:
            key = next(iter(r.keys(f"vlserve:feat:*:{image_id_of(data)}")), None)
        restartable_redis.pause()
        try:
            refused = client.post("/images", json={"image": base64.b64encode(make_png(72)).decode()})
            inline = client.post("/vqa", json={"image": base64.b64encode(make_png(73)).decode(), "question": "what?"})
        finally:
            restartable_redis.resume()
    assert again.status_code == 200 and again.json()["cached"] and key is not None, "written back to Redis"
    assert_problem(refused, 503, "store-unavailable")
    assert int(refused.headers["retry-after"]) >= 1 and inline.status_code == 200


def test_metrics_count_the_entries_written_back(make_settings, restartable_redis, make_png):
    """/metrics exports the shared store's refreshes and write-backs (a flushed entry a pod still held, put back)."""
    import base64

    from tests.service.conftest import metric

    with TestClient(create_app(make_settings(redis_url=restartable_redis.url))) as client:
        assert metric(client, "vlserve_feature_store_restored_total") == 0
        assert client.post("/images", json={"image": base64.b64encode(make_png(81)).decode()}).status_code == 200
        with restartable_redis.client() as r:
            r.flushall()
        assert client.post("/images", json={"image": base64.b64encode(make_png(81)).decode()}).status_code == 200
        assert metric(client, "vlserve_feature_store_restored_total") == 1
        assert metric(client, "vlserve_feature_store_refreshed_total") >= 0
