"""Image bytes -> region features: feature store first, else decode and run the batched detector once.

Decoding is bounded in memory. A `PixelBudget` caps the pixels of images being decoded or waiting for their detector
batch, summed over concurrent requests: a request reserves its image's pixels from the header before decoding and
holds what the decoded array keeps until its detector batch has run. Images larger than the detector needs decode
reduced (models.images.decode_bounded; their regions are scaled back to the original frame), and after a large
decode the freed heap is returned to the OS (glibc malloc_trim), so a burst of large images leaves no high-water
mark behind.

A new image is admitted to the detector before its pixels are decoded (Batcher.reserve): when the images queued
ahead of it would hold it longer than the detector batcher's max_queue_wait_ms (`detector_max_queue_wait_s`), the
request gets QueueFullError (HTTP 429 with Retry-After) and nothing is decoded. Images the feature store holds
never reach the detector and are never refused.
"""
from __future__ import annotations

import asyncio
import ctypes
import hashlib
import platform
import re
import sys
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np

from models.detector import RegionDetector
from models.detector.extract import extract_each
from models.detector.preprocess import decode_side
from models.images import Decoded, ImageError, decode_bounded, header_pixels
from models.region_features import RegionFeatures

from .batcher import Batcher, BatcherConfig
from .feature_store import FeatureStore
from .shared_work import SharedWork

_IMAGE_ID = re.compile(r"^[0-9a-f]{64}$")
_HASH_INLINE_BYTES = 1 << 20  # sha256 of 1 MiB takes ~1 ms; larger bodies are hashed in a thread
# Decodes of at least this many pixels (16 MB as Pillow's 4-byte RGB) hand freed heap back to the OS afterwards:
# glibc serves such buffers from its arenas once its mmap threshold has grown, and keeps them when freed.
# malloc_trim took 15 ms after a 40 Mpx decode on 2 cores, against 0.5 s for the decode itself.
_TRIM_PIXELS = 4_000_000


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (macOS, Windows, musl)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS (glibc malloc_trim(0)); False where that is not available."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


class PixelBudget:
    """At most `capacity` pixels reserved at once; reservations wait their turn in arrival order.

    First come, first served: a large image waiting for room is not overtaken by a stream of small ones. A
    reservation larger than the whole capacity is cut to it (such an image decodes alone).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.in_use = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for _, f in self._waiting if not f.done())

    async def acquire(self, pixels: int) -> int:
        """Wait until `pixels` (cut to the capacity) fit and reserve them; returns what was reserved."""
        n = max(0, min(int(pixels), self.capacity))
        if not self._waiting and self.in_use + n <= self.capacity:
            self.in_use += n
            return n
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((n, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # granted just as the waiter was cancelled
                self.release(n)
            else:
                self._grant()  # it may have been first in line
            raise
        return n

    def release(self, pixels: int) -> None:
        self.in_use -= pixels
        if self.in_use < 0:
            raise RuntimeError(f"released {pixels} pixels more than were reserved")
        self._grant()

    def _grant(self) -> None:
        while self._waiting:
            n, turn = self._waiting[0]
            if turn.done():  # its waiter was cancelled
                self._waiting.popleft()
                continue
            if self.in_use + n > self.capacity:
                return
            self._waiting.popleft()
            self.in_use += n
            turn.set_result(None)


class UnknownImageError(KeyError):
    """An image_id the feature store does not hold (never registered, evicted or expired); a store that cannot be
    asked raises feature_store.StoreUnavailableError instead."""

    def __init__(self, image_id: str, more: Sequence[str] = ()) -> None:
        super().__init__(image_id)
        self.image_id = image_id
        # every well-formed id of the request the store does not hold, in order: what a client registers again
        self.image_ids = [i for i in dict.fromkeys((image_id, *more)) if is_image_id(i)]

    def __str__(self) -> str:
        shown = self.image_id if len(self.image_id) <= 80 else self.image_id[:80] + "..."
        if not is_image_id(self.image_id):
            return f"image_id {shown!r} is not a sha256 hex digest (64 lowercase hex characters)"
        others = len(self.image_ids) - 1
        also = f" (and {others} more of the request's image_ids, listed in image_ids)" if others else ""
        return (f"unknown image_id {shown}{also}: no regions are cached for it (never registered, evicted or "
                "expired); send the image itself or register it again with POST /images")


def image_id_of(data: bytes) -> str:
    """The id of an image: sha256 hex digest of its bytes."""
    return hashlib.sha256(data).hexdigest()


def is_image_id(value: str) -> bool:
    return bool(_IMAGE_ID.match(value))


class RegionService:
    """Region features of images, computed at most once per image (per store lifetime) and batched.

    Concurrent requests for the same image share one lookup and one detector run (single flight), which stops only
    when every request waiting for it has gone (their clients went away: service/shared_work.py). A fresh
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
        *,
        max_pixels_in_flight: int = 0,
        reduced_decoding: bool = False,
    ) -> None:
        """max_pixels_in_flight: the PixelBudget of decodes and detector inputs (0 = unbounded, and freed heap is
        not trimmed); reduced_decoding: decode images longer than decode_side(detector config) reduced."""
        self.detector = detector
        self.store = store
        self.max_pixels = max_pixels
        self.max_decode_side = decode_side(detector.config) if reduced_decoding else None
        self.budget = PixelBudget(max_pixels_in_flight) if max_pixels_in_flight > 0 else None
        self._fingerprint = fingerprint
        self._on_batch = on_batch
        self._batcher: Batcher[np.ndarray, RegionFeatures] = Batcher(
            "detector", self._extract, config, executor, on_batch=self._count_batch)
        self._inflight: dict[str, SharedWork[tuple[RegionFeatures, bool]]] = {}
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

    def expect(self, batch_seconds: float) -> None:
        """The detector's batch time to admit new images by until a batch has been measured (Batcher.expect)."""
        self._batcher.expect(batch_seconds)

    async def stop(self, timeout_s: float | None = None) -> None:
        """Finish queued detector work and the store writes that follow it, within timeout_s in all; then what is
        left fails (BatcherClosedError) or is cancelled."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        await self._batcher.stop(timeout_s)
        pending = {work.task for work in self._inflight.values()}
        if pending:
            left = None if deadline is None else max(deadline - loop.time(), 0.0)
            _, pending = await asyncio.wait(pending, timeout=left)
            for task in pending:  # a store write or a decode still going when the time is up
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def close_now(self) -> int:
        """The shutdown budget has run out: images queued for the detector, and the batch running, fail at once
        (Batcher.close_now); returns how many."""
        return self._batcher.close_now()

    async def from_bytes(self, data: bytes, register: bool = False) -> tuple[str, RegionFeatures, bool]:
        """(image_id, regions, cache_hit) for image bytes; ImageError if they are not an acceptable image.

        register (POST /images): the answer promises that every pod can use the id, so the shared store must hold
        the regions afterwards (written back from this pod's copy if it had lost them): StoreUnavailableError when it
        cannot. An inline image is served whatever its store write did."""
        # hashlib releases the GIL: a large body is hashed off the event loop
        image_id = image_id_of(data) if len(data) < _HASH_INLINE_BYTES else await asyncio.to_thread(image_id_of, data)
        rf, hit = await self._single_flight(image_id, lambda: self._lookup_or_extract(image_id, data))
        if register:
            await self.store.share(image_id, rf)
        return image_id, rf, hit

    async def from_id(self, image_id: str) -> RegionFeatures:
        """Regions of an image registered earlier; UnknownImageError if the store does not hold them,
        StoreUnavailableError if the store cannot be asked now."""
        if not is_image_id(image_id):
            raise UnknownImageError(image_id)
        work = self._inflight.get(image_id)  # being registered right now: wait for it
        if work is not None and not work.abandoned:
            try:
                rf, _ = await work.join()
            except ImageError:  # the bytes being registered under this id were no image: it stays unknown
                raise UnknownImageError(image_id) from None
            return rf
        rf = await self.store.get(image_id, strict=True)  # an unreachable store: StoreUnavailableError, not unknown
        if rf is None:
            raise UnknownImageError(image_id)
        return rf

    async def from_ids(self, image_ids: Sequence[str]) -> list[RegionFeatures]:
        """Regions of images registered earlier, in order, looked up in one batch (store.get_many: one round trip
        to Redis for them all); UnknownImageError naming every unknown id (a malformed one alone), StoreUnavailableError
        if the store cannot be asked now."""
        registering = {i for i, work in self._inflight.items() if not work.abandoned}
        asked = [i for i in dict.fromkeys(image_ids) if is_image_id(i) and i not in registering]
        found = dict(zip(asked, await self.store.get_many(asked, strict=True)))
        regions, unknown = [], []
        for image_id in image_ids:
            if image_id in found:
                rf = found[image_id]
            elif not is_image_id(image_id):  # refused as malformed before any unknown one is listed
                raise UnknownImageError(image_id)
            else:  # being registered right now
                try:
                    rf = await self.from_id(image_id)
                except UnknownImageError:
                    rf = None
            if rf is None:
                unknown.append(image_id)
            regions.append(rf)
        if unknown:
            raise UnknownImageError(unknown[0], unknown[1:])
        return regions

    def stats(self) -> dict[str, int | float]:
        return {"detector_runs": self.detector_runs, "detector_seconds": self.detector_seconds,
                "queue_depth": self.queue_depth, "in_flight": len(self._inflight),
                "decode_pixels_in_flight": self.budget.in_use if self.budget else 0,
                "decode_waiting": self.budget.waiting if self.budget else 0}

    # --- internals ---------------------------------------------------------------------------------

    async def _single_flight(self, image_id: str, work) -> tuple[RegionFeatures, bool]:
        """One task per image id at a time; callers share it, and it stops only when every caller has gone."""
        shared = self._inflight.get(image_id)
        if shared is None or shared.abandoned:
            shared = SharedWork(work(), name=f"regions-{image_id[:12]}")
            self._inflight[image_id] = shared
            shared.task.add_done_callback(lambda _: self._finished(image_id, shared))
        return await shared.join()

    def _finished(self, image_id: str, shared: SharedWork) -> None:
        if self._inflight.get(image_id) is shared:
            del self._inflight[image_id]

    async def _lookup_or_extract(self, image_id: str, data: bytes) -> tuple[RegionFeatures, bool]:
        rf = await self.store.get(image_id)
        if rf is not None:
            return rf, True
        rf = await self._decode_and_extract(data)
        await self.store.put(image_id, rf)
        return rf, False

    async def _decode_and_extract(self, data: bytes) -> RegionFeatures:
        """Regions as the store keeps them (features float16), in the original image's frame. The detector admits the
        image first (QueueFullError: a 429 before any pixel is decoded); admitted, it counts as queued while it
        waits for decoding room and decodes."""
        if self.budget is None:
            place = self._batcher.reserve()
            try:
                decoded = await asyncio.to_thread(decode_bounded, data, self.max_pixels, self.max_decode_side)
                rf = await self._batcher.submit(decoded.image, reservation=place)
            finally:
                place.release()
            return rf.rescaled(decoded.original_hw).to_float16()
        pixels = header_pixels(data, self.max_pixels, self.max_decode_side)  # ImageError for a bad header, as decoding
        place = self._batcher.reserve()
        held = 0
        try:
            held = await self.budget.acquire(pixels)
            self._batcher.check_open()  # shut down while waiting for room: decode nothing
            decoded = await asyncio.to_thread(self._decode, data, pixels)  # big images take a while
            keep = min(held, decoded.image.shape[0] * decoded.image.shape[1])  # what waits for the detector
            self.budget.release(held - keep)
            held = keep
            original_hw = decoded.original_hw
            rf = await self._batcher.submit(decoded.image, reservation=place)
            del decoded  # the batch has run: the decoded pixels are freed here, before their reservation ends
            return rf.rescaled(original_hw).to_float16()
        finally:
            place.release()
            self.budget.release(held)

    def _decode(self, data: bytes, pixels: int) -> Decoded:
        """decode_bounded in a worker thread; a large decode hands its freed full-size buffers back to the OS."""
        decoded = decode_bounded(data, self.max_pixels, self.max_decode_side)
        if pixels >= _TRIM_PIXELS:
            release_free_memory()
        return decoded

    def _extract(self, images: list[np.ndarray]) -> list[RegionFeatures | Exception]:
        """The detector on a batch; an image that breaks it fails its own request only (extract_each)."""
        return extract_each(self.detector, images, len(images))

    def _count_batch(self, batch_size: int, max_wait_s: float, run_s: float) -> None:
        self.detector_runs += batch_size
        self.detector_seconds += run_s
        if self._on_batch is not None:
            self._on_batch(batch_size, max_wait_s, run_s)
