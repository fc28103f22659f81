"""Feature store: region features by image id, in Redis (shared by pods) or in an in-process LRU.

A store never raises on get/put: a corrupt or foreign value is a miss, and an unreachable Redis means
"compute and serve without cache" (DESIGN.md). Values are `RegionFeatures.to_bytes()` (safetensors with a
format version), so what comes back is exactly what a fresh extraction stored, features in float16.
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from models.region_features import FeatureFormatError, RegionFeatures

if TYPE_CHECKING:
    from .settings import Settings

log = logging.getLogger(__name__)

KEY_PREFIX = "vlserve:feat"
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)  # Redis down, restarting or too slow
_POOL_EXHAUSTED = "No connection available."  # BlockingConnectionPool: every connection busy for its timeout


class StoreUnavailableError(RuntimeError):
    """The store cannot be asked now (Redis down, hung or in its back-off): an `image_id` lookup cannot tell a
    registered image from an unknown one, so it answers 503 with Retry-After, never 404 (HTTP 503
    /problems/store-unavailable). Inline images are unaffected: they are computed and served without the cache."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"the feature store is unreachable, so registered images cannot be looked up now; retry in "
                         f"{max(1, round(retry_after_s))} s, or send the image itself")
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

    async def close(self) -> None:
        """Release connections; the store must not be used afterwards."""

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "hits": self.hits, "misses": self.misses, "errors": self.errors,
                "skipped": self.skipped, "pool_waits": self.pool_waits, "corrupt": self.corrupt, "available": self.available}

    def _decode(self, value: bytes, where: str) -> RegionFeatures | None:
        """Stored bytes -> regions, or None (a miss) when they are not a value this version reads."""
        try:
            rf = RegionFeatures.from_bytes(value)
        except FeatureFormatError as exc:
            self.corrupt += 1
            self.misses += 1
            log.warning("feature store %s: ignoring unreadable value at %s (%s)", self.name, where, exc)
            return None
        self.hits += 1
        return rf


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
            log.warning("feature store memory: %d-byte value exceeds max_bytes=%d; not cached", size, self.max_bytes)
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
                "evictions": self.evictions}

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

    Connections come from a blocking pool of `max_connections`: under load a command waits (up to `timeout_s`)
    for a free connection instead of failing with "too many connections", and waiting for one is not an outage
    (no back-off). A connection that broke while idle (Redis restarted) is replaced and the command retried
    once on a fresh one, so a restart costs no failed lookups once Redis is back; a timeout is never retried.
    """

    name = "redis"

    def __init__(self, url: str, fingerprint: str, ttl_s: int, *, timeout_s: float = 0.5, backoff_s: float = 1.0,
                 max_connections: int = 32) -> None:
        super().__init__()
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.url = url
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s
        self.backoff_s = backoff_s
        self._down_until = 0.0  # time.monotonic() before which Redis is not tried
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s, socket_timeout=timeout_s,
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
        if not self.available:
            self.skipped += 1
            if strict:
                raise StoreUnavailableError(self._down_until - time.monotonic())
            return None
        key = self.key(image_id)
        try:
            value = await self._redis.get(key)
        except (RedisError, *_UNREACHABLE) as exc:
            self._failed("get", exc)
            if strict:
                raise StoreUnavailableError(max(self._down_until - time.monotonic(), 1.0)) from None
            return None
        if value is None:
            self.misses += 1
            return None
        return self._decode(value, key)  # a corrupt value stays until the next put overwrites it

    async def put(self, image_id: str, rf: RegionFeatures) -> None:
        if not self.available:
            self.skipped += 1
            return
        try:
            await self._redis.set(self.key(image_id), rf.to_bytes(), ex=self.ttl_s)
        except (RedisError, *_UNREACHABLE) as exc:
            self._failed("put", exc)

    async def ping(self) -> bool:
        """True when Redis answers now (ignores the back-off; for readiness details, not for requests)."""
        try:
            return bool(await self._redis.ping())
        except (RedisError, *_UNREACHABLE):
            return False

    async def close(self) -> None:
        try:
            await self._redis.aclose()
        except (RedisError, *_UNREACHABLE) as exc:  # closing a broken connection is not worth a crash at shutdown
            log.debug("feature store redis: error on close (%s)", exc)

    def _failed(self, op: str, exc: BaseException) -> None:
        self.errors += 1
        if isinstance(exc, RedisConnectionError) and str(exc) == _POOL_EXHAUSTED:  # busy, not down: no back-off
            self.pool_waits += 1
            log.warning("feature store redis: %s found no free connection in %d for its timeout",
                        op, self._redis.connection_pool.max_connections)
        elif isinstance(exc, _UNREACHABLE):
            was_up = self.available
            self._down_until = time.monotonic() + self.backoff_s
            if was_up:
                log.warning("feature store redis: %s failed (%s: %s); serving without cache, retrying in %.1f s",
                            op, type(exc).__name__, exc, self.backoff_s)
        else:  # e.g. a ResponseError (OOM under noeviction, READONLY replica): Redis is up, this call failed
            log.warning("feature store redis: %s failed (%s: %s)", op, type(exc).__name__, exc)


class TieredStore(FeatureStore):
    """Redis, shared by every pod, behind this pod's in-process LRU: an image the pod has seen lately is answered
    with no round trip and no decoding (under load those were most of the event loop's work per request, and the
    accepted requests' latency with them); one it has not is looked up in Redis and then kept locally too. Every
    put goes to both. Values are a pure function of the image bytes and the detector, so a local copy is never stale.
    While Redis is away the local tier still answers what it holds."""

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
        rf = await self.local.get(image_id)
        if rf is not None:
            return rf
        rf = await self.shared.get(image_id, strict)
        if rf is not None:
            await self.local.put(image_id, rf)
        return rf

    async def put(self, image_id: str, rf: RegionFeatures) -> None:
        await self.local.put(image_id, rf)
        await self.shared.put(image_id, rf)

    async def ping(self) -> bool:
        return await self.shared.ping()

    async def close(self) -> None:
        await self.local.close()
        await self.shared.close()

    def stats(self) -> dict[str, Any]:
        local = self.local.stats()
        return {**self.shared.stats(), "hits": self.hits, "local_hits": local["hits"], "local_items": local["items"],
                "local_bytes": local["bytes"]}


def create_store(settings: Settings, fingerprint: str) -> FeatureStore:
    """Redis (behind the pod's in-process LRU) when settings.redis_url is set, otherwise the in-process LRU alone."""
    local = InProcessStore(settings.cache_max_bytes, fingerprint)
    if settings.redis_url:
        return TieredStore(local, RedisStore(settings.redis_url, fingerprint, settings.redis_ttl_s,
                                             max_connections=settings.redis_max_connections))
    return local
