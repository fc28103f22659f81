"""Image bytes -> region features: feature store first, else decode and run the batched detector once."""
from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

from models.detector import RegionDetector
from models.images import ImageError, decode_image
from models.region_features import RegionFeatures

from .batcher import Batcher, BatcherConfig
from .feature_store import FeatureStore

_IMAGE_ID = re.compile(r"^[0-9a-f]{64}$")
_HASH_INLINE_BYTES = 1 << 20  # sha256 of 1 MiB takes ~1 ms; larger bodies are hashed in a thread


class UnknownImageError(KeyError):
    """An image_id the feature store does not hold (never registered, evicted, expired, or Redis down)."""

    def __init__(self, image_id: str) -> None:
        super().__init__(image_id)
        self.image_id = image_id

    def __str__(self) -> str:
        shown = self.image_id if len(self.image_id) <= 80 else self.image_id[:80] + "..."
        if not is_image_id(self.image_id):
            return f"image_id {shown!r} is not a sha256 hex digest (64 lowercase hex characters)"
        return (f"unknown image_id {shown}: no regions are cached for it (never registered, evicted or expired); "
                "send the image itself or register it again with POST /images")


def image_id_of(data: bytes) -> str:
    """The id of an image: sha256 hex digest of its bytes."""
    return hashlib.sha256(data).hexdigest()


def is_image_id(value: str) -> bool:
    return bool(_IMAGE_ID.match(value))


class RegionService:
    """Region features of images, computed at most once per image (per store lifetime) and batched.

    Concurrent requests for the same image share one lookup and one detector run (single flight). A fresh
    extraction is returned as the store would return it (features float16), so answers never depend on
    whether the cache was warm. The service does not own the store: close it after stop().
    """

    def __init__(
        self,
        detector: RegionDetector,
        fingerprint: str,
        store: FeatureStore,
        config: BatcherConfig,
        max_pixels: int,
        executor: Executor | None = None,
        on_batch: Callable[[int, float, float], None] | None = None,
    ) -> None:
        self.detector = detector
        self.store = store
        self.max_pixels = max_pixels
        self._fingerprint = fingerprint
        self._on_batch = on_batch
        self._batcher: Batcher[np.ndarray, RegionFeatures] = Batcher(
            "detector", self._extract, config, executor, on_batch=self._count_batch)
        self._inflight: dict[str, asyncio.Task[tuple[RegionFeatures, bool]]] = {}
        self.detector_runs = 0  # images the detector processed
        self.detector_seconds = 0.0  # time spent in detector batches

    @property
    def fingerprint(self) -> str:
        """Detector identity (part of every feature-store key)."""
        return self._fingerprint

    @property
    def queue_depth(self) -> int:
        return self._batcher.queue_depth

    async def start(self) -> None:
        await self._batcher.start()

    async def stop(self, timeout_s: float | None = None) -> None:
        """Finish queued detector work and the store writes that follow it."""
        await self._batcher.stop(timeout_s)
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)

    async def from_bytes(self, data: bytes) -> tuple[str, RegionFeatures, bool]:
        """(image_id, regions, cache_hit) for image bytes; ImageError if they are not an acceptable image."""
        # hashlib releases the GIL: a large body is hashed off the event loop
        image_id = image_id_of(data) if len(data) < _HASH_INLINE_BYTES else await asyncio.to_thread(image_id_of, data)
        rf, hit = await self._single_flight(image_id, lambda: self._lookup_or_extract(image_id, data))
        return image_id, rf, hit

    async def from_id(self, image_id: str) -> RegionFeatures:
        """Regions of an image registered earlier; UnknownImageError if the store does not hold them."""
        if not is_image_id(image_id):
            raise UnknownImageError(image_id)
        task = self._inflight.get(image_id)  # being registered right now: wait for it
        if task is not None:
            try:
                rf, _ = await asyncio.shield(task)
            except ImageError:  # the bytes being registered under this id were no image: it stays unknown
                raise UnknownImageError(image_id) from None
            return rf
        rf = await self.store.get(image_id)
        if rf is None:
            raise UnknownImageError(image_id)
        return rf

    def stats(self) -> dict[str, int | float]:
        return {"detector_runs": self.detector_runs, "detector_seconds": self.detector_seconds,
                "queue_depth": self.queue_depth, "in_flight": len(self._inflight)}

    # --- internals ---------------------------------------------------------------------------------

    async def _single_flight(self, image_id: str, work) -> tuple[RegionFeatures, bool]:
        """One task per image id at a time; callers share it, and a cancelled caller does not cancel it."""
        task = self._inflight.get(image_id)
        if task is None:
            task = asyncio.create_task(work(), name=f"regions-{image_id[:12]}")
            self._inflight[image_id] = task
            task.add_done_callback(lambda t: self._finished(image_id, t))
        return await asyncio.shield(task)

    def _finished(self, image_id: str, task: asyncio.Task) -> None:
        if self._inflight.get(image_id) is task:
            del self._inflight[image_id]
        if not task.cancelled():
            task.exception()  # retrieved here so a failure nobody awaited any more is not logged as "never retrieved"

    async def _lookup_or_extract(self, image_id: str, data: bytes) -> tuple[RegionFeatures, bool]:
        rf = await self.store.get(image_id)
        if rf is not None:
            return rf, True
        image = await asyncio.to_thread(decode_image, data, self.max_pixels)  # big images take a while
        rf = (await self._batcher.submit(image)).to_float16()  # what the store returns on the next request
        await self.store.put(image_id, rf)
        return rf, False

    def _extract(self, images: list[np.ndarray]) -> list[RegionFeatures]:
        return self.detector.extract(images, batch_size=len(images))

    def _count_batch(self, batch_size: int, max_wait_s: float, run_s: float) -> None:
        self.detector_runs += batch_size
        self.detector_seconds += run_s
        if self._on_batch is not None:
            self._on_batch(batch_size, max_wait_s, run_s)
