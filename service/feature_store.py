"""Feature store: region features by image id, in Redis (shared by pods) or in an in-process LRU.

A store never raises on get/put: a corrupt or foreign value (unreadable bytes, another Redis type, another feature
width) is a miss, and an unreachable Redis means "compute and serve without cache" (DESIGN.md). Only a strict
lookup (an `image_id`) and `share` (POST /images) raise StoreUnavailableError, since their answer would otherwise
claim something about the shared store that nobody checked. Values are `RegionFeatures.to_bytes()` (safetensors with
a format version), so what comes back is exactly what a fresh extraction stored, features in float16.

In Redis an entry lives `ttl_s` after its last use by any pod: every use (a pod's local hit included) refreshes its
TTL and its LRU recency, in the background and at most once per key per `refresh_s`, and writes the value back when
Redis lost it (expired, evicted, flushed, restarted), so hot images are not the ones Redis evicts.
"""
from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.asyncio.connection import parse_url
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from models.region_features import FeatureFormatError, RegionFeatures

from .settings import redact_url

if TYPE_CHECKING:
    from .settings import Settings

log = logging.getLogger("vlserve.feature_store")

KEY_PREFIX = "vlserve:feat"
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)  # Redis down, restarting or too slow
# Redis's refusals that are its passing state, not this client's settings: at start-up a warning, as an unreachable
# Redis is (a disk it cannot persist to, memory full, a dataset loading, a script running, a failover)
PASSING_REFUSALS = frozenset({"MISCONF", "OOM", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN"})
_POOL_EXHAUSTED = "No connection available."  # BlockingConnectionPool: every connection busy for its timeout
_MAX_CLIENTS = "max number of clients reached"  # Redis at its maxclients refusing a new connection (redis-py's words)
_POOL_LOG_S = 60.0  # a busy pool is logged at most once a minute (its count is in pool_waits)
_OUTAGE_LOG_S = 30.0  # an outage is logged when it begins, every 30 s while it lasts, and when it ends


def _without_password(url: str, exc: Exception) -> str:
    """A hint where Redis asks for a password that the URL does not give."""
    text = str(exc)
    asks = text.startswith(("NOAUTH", "HELLO must be called")) or "authentication required" in text.lower()
    return "; the URL gives no password (redis://:PASSWORD@HOST:PORT/DB)" if asks and not urlparse(url).password else ""


class StoreConfigError(RuntimeError):
    """Redis refuses this client for good (wrong password, db index out of range, TLS against a plain port): found
    at start-up, which it stops, rather than at every request."""


class StoreUnavailableError(RuntimeError):
    """The store cannot be asked now (Redis down, hung or in its back-off): an `image_id` lookup cannot tell a
    registered image from an unknown one, so it answers 503 with Retry-After, never 404 (HTTP 503
    /problems/store-unavailable). Inline images are unaffected: they are computed and served without the cache."""

    def __init__(self, retry_after_s: float, why: str = "the feature store is unreachable, so registered images "
                                                         "cannot be looked up now") -> None:
        super().__init__(f"{why}; retry in {max(1, round(retry_after_s))} s, or send the image itself")
        self.retry_after_s = retry_after_s


def feature_key(fingerprint: str, image_id: str) -> str:
    """`vlserve:feat:{detector fingerprint}:{sha256 of the image bytes}`: a new detector never reads old entries."""
    return f"{KEY_PREFIX}:{fingerprint}:{image_id}"


class FeatureStore(ABC):
    """Region features by image id. get/put never raise; the counters feed /metrics."""

    name: str = "store"

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.errors = 0  # operations tried that failed: store unreachable, failing or its pool busy (no cache used)
        self.skipped = 0  # operations not tried: the store was backed off after a failure (no cache used)
        self.pool_waits = 0  # of the errors, commands that found no free connection in time
        self.corrupt = 0  # values that were not readable region features (counted as misses too)

    @property
    def available(self) -> bool:
        """False while the store is backed off after a failure (an in-process store always is available)."""
        return True

    @abstractmethod
    async def get(self, image_id: str, strict: bool = False) -> RegionFeatures | None:
        """The stored regions, or None on a miss (absent, corrupt, foreign, or store unavailable).

        strict: an unavailable store raises StoreUnavailableError instead of answering a miss. A lookup by
        `image_id` asks strictly (a miss there means "unknown image", which an outage must not claim); the
        lookup before extracting an inline image does not (it computes on a miss anyway)."""

    @abstractmethod
    async def put(self, image_id: str, rf: RegionFeatures) -> None:
        """Store (or overwrite) the regions of an image; silently skipped if the store is unavailable."""

    async def get_many(self, image_ids: list[str], strict: bool = False) -> list[RegionFeatures | None]:
        """get() of each id, in order (a store with round trips asks for them all at once)."""
        return [await self.get(image_id, strict) for image_id in image_ids]

    async def share(self, image_id: str, rf: RegionFeatures) -> None:
        """Make sure every pod can read the image (POST /images answers its id as usable anywhere); raises
        StoreUnavailableError when the shared store cannot be made to hold it. The in-process store is this pod's."""

    async def check(self) -> None:
        """At start-up: raise StoreConfigError if the store can never work with these settings."""

    async def close(self) -> None:
        """Release connections; the store must not be used afterwards."""

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "hits": self.hits, "misses": self.misses, "errors": self.errors,
                "skipped": self.skipped, "pool_waits": self.pool_waits, "corrupt": self.corrupt, "available": self.available}

    def _decode(self, value: bytes, where: str, feature_dim: int = 0) -> RegionFeatures | None:
        """Stored bytes -> regions, or None (a miss) when they are not a value this version reads, or (feature_dim)
        not the serving detector's width: the encoder cannot read those."""
        try:
            rf = RegionFeatures.from_bytes(value)
        except FeatureFormatError as exc:
            return self._corrupt(where, str(exc))
        widths = {rf.features.shape[-1], *(() if rf.image_feature is None else (rf.image_feature.shape[-1],))}
        if feature_dim and widths != {feature_dim}:
            return self._corrupt(where, f"{'/'.join(map(str, sorted(widths)))}-d features, the detector's are "
                                        f"{feature_dim}-d")
        self.hits += 1
        return rf

    def _corrupt(self, where: str, why: str) -> None:
        self.corrupt += 1
        self.misses += 1
        log.warning("feature store %s: ignoring unreadable value at %s (%s)", self.name, where, why)


def entry_bytes(feature_dim: int, regions: int, image_feature: bool) -> int:
    """Bytes of one image's stored value (what the in-process store's bound counts) with `regions` regions of
    `feature_dim` features, as RegionFeatures.to_bytes writes it (the largest image size in its metadata)."""
    rf = RegionFeatures(boxes=np.zeros((regions, 4)), features=np.zeros((regions, feature_dim), np.float16),
                        obj_ids=np.zeros(regions, np.int64), obj_scores=np.zeros(regions),
                        attr_ids=np.zeros(regions, np.int64), attr_scores=np.zeros(regions),
                        image_hw=(10**9, 10**9), num_boxes=regions,
                        image_feature=np.zeros(feature_dim, np.float16) if image_feature else None)
    return len(rf.to_bytes())


def frozen(rf: RegionFeatures) -> RegionFeatures:
    """The regions with read-only arrays, so one stored value can be handed to every request that asks."""
    for name in ("boxes", "features", "obj_ids", "obj_scores", "attr_ids", "attr_scores", "image_feature"):
        value = getattr(rf, name)
        if value is not None:
            value.setflags(write=False)
    return rf


class InProcessStore(FeatureStore):
    """LRU bounded by the bytes of its stored values (the embedded default; one per process).

    A value is decoded once, when it is put: get hands out that (read-only) RegionFeatures, which is what
    decoding the stored bytes would give, without paying for it on every request.
    """

    name = "memory"

    def __init__(self, max_bytes: int, fingerprint: str = "") -> None:
        super().__init__()
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.evictions = 0
        self.too_large = 0  # values not kept because they alone exceed max_bytes (logged once)
        self._bytes = 0
        self._values: OrderedDict[str, tuple[RegionFeatures, int]] = OrderedDict()  # key -> (value, len(to_bytes())), LRU first

    @property
    def nbytes(self) -> int:
        """Bytes of the stored values (what max_bytes bounds)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._values)

    async def get(self, image_id: str, strict: bool = False) -> RegionFeatures | None:
        key = feature_key(self.fingerprint, image_id)
        entry = self._values.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._values.move_to_end(key)
        self.hits += 1
        return entry[0]

    async def put(self, image_id: str, rf: RegionFeatures) -> None:
        key = feature_key(self.fingerprint, image_id)
        value = rf.to_bytes()
        size = len(value)
        self._drop(key)
        if size > self.max_bytes:
            self.too_large += 1
            log.log(logging.WARNING if self.too_large == 1 else logging.DEBUG,
                    "feature store memory: %d-byte value exceeds max_bytes=%d; not cached (logged once, counted in "
                    "too_large)", size, self.max_bytes)
            return
        try:
            stored = RegionFeatures.from_bytes(value)  # exactly what a store that keeps bytes would hand out
        except FeatureFormatError as exc:  # cannot happen for a valid RegionFeatures; never fail a request over it
            log.warning("feature store memory: not caching %s (%s)", key, exc)
            return
        while self._bytes + size > self.max_bytes:
            self._drop(next(iter(self._values)))
            self.evictions += 1
        self._values[key] = (frozen(stored), size)
        self._bytes += size

    async def close(self) -> None:
        self._values.clear()
        self._bytes = 0

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "items": len(self._values), "bytes": self._bytes, "max_bytes": self.max_bytes,
                "evictions": self.evictions, "too_large": self.too_large}

    def _drop(self, key: str) -> None:
        entry = self._values.pop(key, None)
        if entry is not None:
            self._bytes -= entry[1]


class RedisStore(FeatureStore):
    """Redis (redis.asyncio + hiredis), SET with EX ttl; shared by every pod.

    Run Redis with `maxmemory-policy allkeys-lru` (and a `maxmemory`) so it evicts old images instead of
    refusing writes; the server owns that policy (tests, docs and k8s config set it), never this client.
    Short socket timeouts and a back-off keep a dead Redis cheap: after a failure, Redis is skipped for
    `backoff_s` (an inline image is computed without the cache, an `image_id` lookup answers
    StoreUnavailableError), then tried again, so the store recovers on its own.

    Connections come from a blocking pool of `max_connections`: under load a command waits (up to `pool_timeout_s`)
    for a free connection instead of failing with "too many connections", and waiting for one is not an outage
    (no back-off; a lookup that waited in vain says the store is busy, not unreachable). A connection that broke while
    idle (Redis restarted) is replaced and the command retried once on a fresh one, so a restart costs no failed
    lookups once Redis is back; a timeout is never retried.

    Every use of an entry (`used`: a hit here or in a pod's local tier) refreshes its TTL and recency (EXPIRE) in the
    background, at most once per key per `refresh_s` (default min(ttl_s / 10, 60 s)), one pipeline for all that are
    due, and writes it back when Redis no longer has it.
    """

    name = "redis"

    def __init__(self, url: str, fingerprint: str, ttl_s: int, *, feature_dim: int = 0, timeout_s: float = 0.5,
                 pool_timeout_s: float = 2.0, backoff_s: float = 1.0, max_connections: int = 32,
                 refresh_s: float | None = None) -> None:
        """feature_dim: the serving detector's feature width (0 = any): a value of another width is a corrupt miss."""
        super().__init__()
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.url = url
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s
        self.feature_dim = feature_dim
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.refresh_s = min(ttl_s / 10, 60.0) if refresh_s is None else refresh_s
        self.refreshed = 0  # entries whose TTL and recency a use refreshed
        self.restored = 0  # entries written back from a pod's copy after Redis had lost them
        self._down_until = 0.0  # time.monotonic() before which Redis is not tried
        self._outage: tuple[float, float] | None = None  # (since, last warned) while Redis cannot be reached
        self._pool_logged = -_POOL_LOG_S
        self._refusals: dict[str, tuple[float, int]] = {}  # kind of refusal -> (last logged, how many since)
        self._fresh: OrderedDict[str, float] = OrderedDict()  # key -> when its TTL was last set, oldest first
        self._due: dict[str, RegionFeatures] = {}  # image id -> value, whose TTL the refresher sets next
        self._refresher: asyncio.Task | None = None
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, decode_responses=False, client_name="vlserve",
            retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError], retry_on_timeout=False)
        self._redis = aioredis.Redis(connection_pool=pool)

    @property
    def available(self) -> bool:
        """False during a back-off after a failure."""
        return time.monotonic() >= self._down_until

    def key(self, image_id: str) -> str:
        return feature_key(self.fingerprint, image_id)

    async def get(self, image_id: str, strict: bool = False) -> RegionFeatures | None:
        """A lookup not tried (back-off) counts as skipped, one that failed as an error; neither is a miss, which
        means Redis answered and held nothing usable."""
        return (await self._read([image_id], strict))[0]

    async def get_many(self, image_ids: list[str], strict: bool = False) -> list[RegionFeatures | None]:
        """One MGET for them all (a key of another Redis type reads as absent)."""
        return await self._read(image_ids, strict) if image_ids else []

    async def put(self, image_id: str, rf: RegionFeatures) -> None:
        if not self.available:
            self.skipped += 1
            return
        key = self.key(image_id)
        try:
            await self._redis.set(key, rf.to_bytes(), ex=self.ttl_s)
        except (RedisError, *_UNREACHABLE) as exc:
            self._failed("put", exc)
            return
        self._reached()
        self._set_fresh(key)

    async def share(self, image_id: str, rf: RegionFeatures) -> None:
        """EXPIRE (TTL and recency refreshed, 0 when the key is gone), then SET from this copy if it was gone."""
        why = "the image's regions could not be written to the shared feature store, so other pods would not know its " \
              "image_id"
        if not self.available:
            self.skipped += 1
            raise StoreUnavailableError(self._down_until - time.monotonic(), why)
        key = self.key(image_id)
        try:
            if not await self._redis.expire(key, self.ttl_s):
                await self._redis.set(key, rf.to_bytes(), ex=self.ttl_s)
                self.restored += 1
        except (RedisError, *_UNREACHABLE) as exc:
            self._failed("put", exc)
            raise StoreUnavailableError(max(self._down_until - time.monotonic(), 1.0),
                                        f"{why} (Redis: {type(exc).__name__}: {exc})") from None
        self._reached()
        self._set_fresh(key)

    def used(self, image_id: str, rf: RegionFeatures) -> None:
        """The entry was used now: refresh its TTL and recency in the background unless done in the last refresh_s
        (rf is written back if Redis lost it)."""
        key = self.key(image_id)
        now = time.monotonic()
        last = self._fresh.get(key)
        if last is not None and now - last < self.refresh_s:
            return
        self._set_fresh(key, now)
        self._due[image_id] = rf
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh(), name="feature-store-refresh")

    async def check(self) -> None:
        """PING once: authentication, db index or TLS refused for good raise StoreConfigError; an unreachable Redis
        is one warning (it may come later; inline images are served meanwhile)."""
        where = redact_url(self.url)
        try:
            await self._redis.ping()
        except (AuthenticationError, ResponseError) as exc:  # AuthenticationError is a ConnectionError: first
            if isinstance(exc, ResponseError) and str(exc).split(" ", 1)[0] in PASSING_REFUSALS:
                return self._unreachable_at_start(where, exc)  # the server's state, not this client's settings
            raise StoreConfigError(f"the feature store at {where} (VLSERVE_REDIS_URL) refuses this client: "
                                   f"{exc}{_without_password(self.url, exc)}") from None
        except (RedisError, *_UNREACHABLE) as exc:
            if self.url.startswith("rediss://") and await self._speaks_plain_redis():
                raise StoreConfigError(f"the feature store at {where} (VLSERVE_REDIS_URL) asks for TLS (rediss://) "
                                       f"but the server speaks plain Redis: use redis://") from None
            self._unreachable_at_start(where, exc)

    def _unreachable_at_start(self, where: str, exc: Exception) -> None:
        log.warning("feature store %s unreachable at start-up (%s: %s); starting without it: inline images are "
                    "served, image_id requests answer 503 until it answers", where, type(exc).__name__, exc)
        now = time.monotonic()
        self._outage = (now, now)  # logged: the first failed command does not warn again; _reached says it ended

    async def ping(self) -> bool:
        """True when Redis answers now (ignores the back-off; for readiness details, not for requests)."""
        try:
            return bool(await self._redis.ping())
        except (RedisError, *_UNREACHABLE):
            return False

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        try:
            await self._redis.aclose()
        except (RedisError, *_UNREACHABLE) as exc:  # closing a broken connection is not worth a crash at shutdown
            log.debug("feature store redis: error on close (%s)", exc)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "refreshed": self.refreshed, "restored": self.restored}

    async def _read(self, image_ids: list[str], strict: bool) -> list[RegionFeatures | None]:
        if not self.available:
            self.skipped += 1
            if strict:
                raise StoreUnavailableError(self._down_until - time.monotonic())
            return [None] * len(image_ids)
        keys = [self.key(i) for i in image_ids]
        try:
            values = [await self._redis.get(keys[0])] if len(keys) == 1 else await self._redis.mget(keys)
        except ResponseError as exc:
            self._reached()  # Redis answered, with an error
            if not str(exc).startswith("WRONGTYPE"):
                self._failed("get", exc)
                if strict:
                    raise StoreUnavailableError(1.0, f"the feature store failed ({exc})") from None
            else:  # another type under our key: overwritten by the next put
                self._corrupt(keys[0], str(exc))
            return [None] * len(image_ids)
        except (RedisError, *_UNREACHABLE) as exc:
            busy = self._failed("get", exc)
            if strict:
                raise (StoreUnavailableError(1.0, "the feature store is busy (all its connections in use)") if busy
                       else StoreUnavailableError(max(self._down_until - time.monotonic(), 1.0))) from None
            return [None] * len(image_ids)
        self._reached()
        found: list[RegionFeatures | None] = []
        for image_id, key, value in zip(image_ids, keys, values):
            rf = None
            if value is None:
                self.misses += 1
            else:
                rf = self._decode(value, key, self.feature_dim)  # a corrupt value stays until a put overwrites it
            if rf is not None:
                self.used(image_id, rf)
            found.append(rf)
        return found

    async def _refresh(self) -> None:
        """EXPIRE every entry due, in one pipeline, then SET those Redis had lost; until none is due."""
        while self._due:
            due, self._due = self._due, {}
            if not self.available:
                self.skipped += 1
                for image_id in due:  # tried again at their next use
                    self._fresh.pop(self.key(image_id), None)
                continue
            ids = list(due)
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for image_id in ids:
                        pipe.expire(self.key(image_id), self.ttl_s)
                    kept = await pipe.execute()
                self._reached()
                lost = [image_id for image_id, ok in zip(ids, kept) if not ok]
                if lost:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for image_id in lost:
                            pipe.set(self.key(image_id), due[image_id].to_bytes(), ex=self.ttl_s)
                        await pipe.execute()
            except (RedisError, *_UNREACHABLE) as exc:
                self._failed("refresh", exc)
                for image_id in ids:
                    self._fresh.pop(self.key(image_id), None)
                continue
            self.refreshed += len(ids) - len(lost)
            self.restored += len(lost)

    def _set_fresh(self, key: str, now: float | None = None) -> None:
        """Remember when key's TTL was set; keys set longer than refresh_s ago are forgotten (bounded by the keys used
        in one refresh_s)."""
        now = time.monotonic() if now is None else now
        self._fresh[key] = now
        self._fresh.move_to_end(key)
        while self._fresh:
            oldest, when = next(iter(self._fresh.items()))
            if now - when < self.refresh_s:
                break
            del self._fresh[oldest]

    async def _speaks_plain_redis(self) -> bool:
        """Whether the URL's host and port answer a plain-text PING (any Redis answer, an auth error included)."""
        target = parse_url(self.url)
        plain = aioredis.Redis(host=target.get("host", "localhost"), port=target.get("port", 6379),
                               socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s)
        try:
            await plain.ping()
            return True
        except (AuthenticationError, ResponseError):
            return True
        except (RedisError, *_UNREACHABLE):
            return False
        finally:
            await plain.aclose()

    def _failed(self, op: str, exc: BaseException) -> bool:
        """Count and log a failed command; True when it only found no free connection (busy, not down)."""
        self.errors += 1
        if isinstance(exc, RedisConnectionError) and str(exc) in (_POOL_EXHAUSTED, _MAX_CLIENTS):  # busy, not down:
            self.pool_waits += 1  # no back-off
            now = time.monotonic()
            if now - self._pool_logged >= _POOL_LOG_S:
                self._pool_logged = now
                pool = self._redis.connection_pool.max_connections
                why = (f"found no free connection in {pool} for its timeout" if str(exc) == _POOL_EXHAUSTED else
                       "could not open a connection: Redis has its maxclients connected (every pod opens up to "
                       f"VLSERVE_REDIS_MAX_CONNECTIONS, {pool} here)")
                log.warning("feature store redis: %s %s (logged at most once a minute; counted in pool_waits)", op, why)
            return True
        if isinstance(exc, _UNREACHABLE):
            was_up = self.available
            now = time.monotonic()
            self._down_until = now + self.backoff_s
            if self._outage is None:
                self._outage = (now, now)
                log.warning("feature store redis: %s failed (%s: %s); serving without cache, retrying every %.1f s",
                            op, type(exc).__name__, exc, self.backoff_s)
            elif was_up and now - self._outage[1] >= _OUTAGE_LOG_S:
                self._outage = (self._outage[0], now)
                log.warning("feature store redis: still unreachable after %.0f s (%s: %s)", now - self._outage[0],
                            type(exc).__name__, exc)
        else:  # e.g. a ResponseError (OOM under noeviction, READONLY replica): Redis is up, this call failed; each
            self._reached()  # kind said when it begins and every _OUTAGE_LOG_S while it lasts, with how many there were
            kind, now = f"{type(exc).__name__} {str(exc).split(' ', 1)[0]}", time.monotonic()
            logged, since = self._refusals.get(kind, (-_OUTAGE_LOG_S, 0))
            if now - logged < _OUTAGE_LOG_S:
                self._refusals[kind] = (logged, since + 1)
            else:
                self._refusals[kind] = (now, 0)
                more = f"; {since} more in the last {now - logged:.0f} s" if since else ""
                log.warning("feature store redis: %s failed (%s: %s)%s (logged at most every %.0f s)", op,
                            type(exc).__name__, exc, more, _OUTAGE_LOG_S)
        return False

    def _reached(self) -> None:
        """A command Redis answered: the end of an outage, if one was logged."""
        if self._outage is not None:
            log.info("feature store redis: reachable again after %.1f s", time.monotonic() - self._outage[0])
            self._outage = None


class TieredStore(FeatureStore):
    """Redis, shared by every pod, behind this pod's in-process LRU: an image the pod has seen lately is answered
    with no round trip and no decoding (under load those were most of the event loop's work per request, and the
    accepted requests' latency with them); one it has not is looked up in Redis and then kept locally too. Every
    put goes to both, and a local hit still counts as a use of the shared entry (RedisStore.used: its TTL and recency
    refreshed in the background, rewritten if Redis lost it), so an image this pod serves stays readable by the others.
    Values are a pure function of the image bytes and the detector, so a local copy is never stale. While Redis is
    away the local tier still answers what it holds."""

    name = "redis"

    def __init__(self, local: InProcessStore, shared: RedisStore) -> None:  # counters are the tiers', not the base's
        self.local = local
        self.shared = shared

    @property
    def hits(self) -> int:
        return self.local.hits + self.shared.hits

    @property
    def misses(self) -> int:  # a lookup that found nothing in either tier (a local miss is not yet a miss)
        return self.shared.misses

    @property
    def errors(self) -> int:
        return self.shared.errors

    @property
    def corrupt(self) -> int:
        return self.shared.corrupt

    @property
    def skipped(self) -> int:
        return self.shared.skipped

    @property
    def pool_waits(self) -> int:
        return self.shared.pool_waits

    @property
    def available(self) -> bool:
        return self.shared.available

    @property
    def backoff_s(self) -> float:
        return self.shared.backoff_s

    async def get(self, image_id: str, strict: bool = False) -> RegionFeatures | None:
        return (await self.get_many([image_id], strict))[0]

    async def get_many(self, image_ids: list[str], strict: bool = False) -> list[RegionFeatures | None]:
        """The local tier first (each hit refreshes the shared entry in the background: shared.used), then one
        round trip to Redis for the rest."""
        found = [await self.local.get(image_id) for image_id in image_ids]
        for image_id, rf in zip(image_ids, found):
            if rf is not None:
                self.shared.used(image_id, rf)
        rest = [image_id for image_id, rf in zip(image_ids, found) if rf is None]
        if not rest:
            return found
        fetched = dict(zip(rest, await self.shared.get_many(rest, strict)))
        for image_id, rf in fetched.items():
            if rf is not None:
                await self.local.put(image_id, rf)
        return [rf if rf is not None else fetched[image_id] for image_id, rf in zip(image_ids, found)]

    async def put(self, image_id: str, rf: RegionFeatures) -> None:
        await self.local.put(image_id, rf)
        await self.shared.put(image_id, rf)

    async def share(self, image_id: str, rf: RegionFeatures) -> None:
        await self.shared.share(image_id, rf)

    async def check(self) -> None:
        await self.shared.check()

    async def ping(self) -> bool:
        return await self.shared.ping()

    async def close(self) -> None:
        await self.local.close()
        await self.shared.close()

    def stats(self) -> dict[str, Any]:
        local = self.local.stats()
        return {**self.shared.stats(), "hits": self.hits, "local_hits": local["hits"], "local_items": local["items"],
                "local_bytes": local["bytes"], "local_too_large": local["too_large"]}


def create_store(settings: Settings, fingerprint: str, feature_dim: int = 0) -> FeatureStore:
    """Redis (behind the pod's in-process LRU unless cache_max_bytes is 0) when settings.redis_url is set, otherwise
    the in-process LRU alone; feature_dim: the serving detector's (values of another width are corrupt misses)."""
    if not settings.redis_url:
        return InProcessStore(settings.cache_max_bytes, fingerprint)
    shared = RedisStore(settings.redis_url, fingerprint, settings.redis_ttl_s, feature_dim=feature_dim,
                        max_connections=settings.redis_max_connections)
    if settings.cache_max_bytes == 0:
        return shared
    return TieredStore(InProcessStore(settings.cache_max_bytes, fingerprint), shared)
