"""Each known image's query-bank prior for text -> image ranking (models.query_bank), computed once per image.

The checkpoint's bank captions are tokenized once at start-up, shortest first (a batch of rows is padded to its
longest, so rows of like length batch together). An image's prior is its scores with every bank caption through the
retrieval head's batcher (one row per caption, batched like any other pairs), kept by image id (a hash of the
image) in a bounded LRU. It is computed when the image is registered (`schedule`, in the background: POST
/images does not wait for it, and its rows run only while no request waits for the encoder) or else by the first
text -> image request that ranks the image; a request that finds a request's computation under way waits for it
instead of repeating it (the computation stops when every request waiting for it has gone: service/shared_work.py),
and one that finds a background computation takes it over in the foreground (a request never waits behind background
work). Priors depend only on the model and the image, so each pod computes its own.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from models.query_bank import QueryBank, image_prior, normalised
from models.region_features import RegionFeatures
from models.tokenizer import VLTokenizer

from .shared_work import SharedWork

log = logging.getLogger("vlserve.query_bank")

# Registered images whose priors wait for the background at once, at most: a pending computation holds the image's
# regions, and under steady load the background (which runs only while no request waits) falls behind registrations
# for as long as the load lasts. Past this the oldest waiting one is dropped (its prior is computed by the first
# request that ranks the image), so memory stays bounded and the newest images, the likeliest to be asked for, wait.
BACKGROUND_MAX_IMAGES = 32

Item = dict[str, np.ndarray]
# (bank token rows, image id, regions) -> the match scores of each row with the image
ScoreRows = Callable[[Sequence[Item], str, RegionFeatures], Awaitable[np.ndarray]]


class BankPriors:
    def __init__(self, bank: QueryBank, tokenizer: VLTokenizer, max_images: int = 100_000,
                 max_length: int | None = None) -> None:
        """`max_length`: the longest row the model can place (its text positions), where it is below the tokenizer's."""
        if max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {max_images}")
        self.bank = bank
        rows = []
        limit = tokenizer.max_length if max_length is None else min(tokenizer.max_length, max_length)
        for text in bank.texts:  # one row per caption, each only as long as its own word pieces
            encoded = tokenizer.encode([text], max_length=limit)
            rows.append({name: value[0] for name, value in encoded.items()})
        self.rows: list[Item] = sorted(rows, key=lambda row: len(row["input_ids"]))  # the prior is order-free
        self.max_images = max_images
        self._priors: OrderedDict[str, float] = OrderedDict()
        self._pending: dict[str, SharedWork[float]] = {}  # priors being computed, by image id
        self._background: dict[str, asyncio.Task] = {}  # scheduled computations by image id, oldest first (the reference
        #                                                  keeps each alive)
        self._running: str | None = None  # the image whose scheduled computation holds the slot
        self.dropped = 0  # scheduled computations dropped for newer ones (BACKGROUND_MAX_IMAGES)
        self._slot: asyncio.Semaphore | None = None  # scheduled computations run one at a time (made in the loop)
        self.computed = 0  # priors computed (misses)

    def __len__(self) -> int:
        return len(self._priors)

    def known(self, image_id: str) -> bool:
        return image_id in self._priors

    async def prior(self, image_id: str, rf: RegionFeatures, score_rows: ScoreRows) -> float:
        """The image's prior: kept, being computed (waited for), or computed now."""
        while True:
            prior = self._priors.get(image_id)
            if prior is not None:
                self._priors.move_to_end(image_id)
                return prior
            scheduled = self._background.get(image_id)
            if scheduled is not None and scheduled is not asyncio.current_task() and not scheduled.done():
                scheduled.cancel()  # a request needs it now: computed below at the request's priority
                await asyncio.gather(scheduled, return_exceptions=True)
                continue
            pending = self._pending.get(image_id)
            if pending is None or pending.abandoned:
                pending = self._pending[image_id] = SharedWork(self._compute(image_id, rf, score_rows),
                                                               name=f"bank-prior-{image_id[:12]}")
                pending.task.add_done_callback(functools.partial(self._computed, image_id, pending))
            try:
                return await pending.join()  # waiters share it; it stops once none waits
            except asyncio.CancelledError:
                if not pending.task.cancelled() or asyncio.current_task().cancelling():
                    raise  # this request is being cancelled
                # the computation was cancelled under it (a scheduled one at shutdown): compute it anew

    async def _compute(self, image_id: str, rf: RegionFeatures, score_rows: ScoreRows) -> float:
        prior = float(image_prior(await score_rows(self.rows, image_id, rf), self.bank.temperature))
        self.computed += 1
        self._priors[image_id] = prior
        while len(self._priors) > self.max_images:
            self._priors.popitem(last=False)
        return prior

    def _computed(self, image_id: str, pending: SharedWork[float], _: asyncio.Task) -> None:
        if self._pending.get(image_id) is pending:
            del self._pending[image_id]

    async def priors(self, images: Sequence[tuple[str, RegionFeatures]], score_rows: ScoreRows) -> np.ndarray:
        """(len(images),) priors, computing those of images not seen yet (each distinct image once)."""
        return np.array([await self.prior(image_id, rf, score_rows) for image_id, rf in images], np.float64)

    def schedule(self, image_id: str, rf: RegionFeatures, score_rows: ScoreRows) -> bool:
        """Compute the image's prior in the background unless it is known, under way or scheduled; True if
        scheduled. Scheduled computations take turns (one image's rows in the batcher's queue at a time, beside the
        requests' own), so registering many images at once never fills the queue."""
        if image_id in self._priors or image_id in self._pending or image_id in self._background:
            return False
        if self._slot is None:
            self._slot = asyncio.Semaphore(1)
        while len(self._background) >= BACKGROUND_MAX_IMAGES:  # the oldest still waiting for its turn makes room
            oldest = next((i for i, task in self._background.items()  # waiting: not computing, nor cancelled already
                           if i != self._running and not task.done() and not task.cancelling()), None)
            if oldest is None:
                break
            self._background.pop(oldest).cancel()
            self.dropped += 1
        task = asyncio.get_running_loop().create_task(self._in_turn(image_id, rf, score_rows), name=f"bank-prior-{image_id}")
        self._background[image_id] = task
        task.add_done_callback(functools.partial(self._finished, image_id))
        return True

    async def _in_turn(self, image_id: str, rf: RegionFeatures, score_rows: ScoreRows) -> None:
        async with self._slot:
            self._running = image_id
            try:
                await self.prior(image_id, rf, score_rows)  # known by now if a request ranked the image meanwhile
            finally:
                self._running = None

    def _finished(self, image_id: str, task: asyncio.Task) -> None:
        if self._background.get(image_id) is task:  # not a newer schedule of the image after this one was dropped
            del self._background[image_id]
        if not task.cancelled() and task.exception() is not None:  # the next request that ranks the image retries
            log.warning("query-bank prior of a registered image failed: %s", task.exception())

    async def settle(self) -> None:
        """Wait for every scheduled computation (tests, benchmarks)."""
        while self._background:
            await asyncio.gather(*self._background.values(), return_exceptions=True)

    async def close(self) -> None:
        """Cancel the scheduled computations (shutdown, before the batchers stop)."""
        for task in self._background.values():
            task.cancel()
        await asyncio.gather(*self._background.values(), return_exceptions=True)

    def normalise(self, scores: np.ndarray, priors: np.ndarray) -> np.ndarray:
        return normalised(scores, priors, self.bank.temperature)
