"""Each known image's query-bank prior for text -> image ranking (models.query_bank), computed once per image.

The checkpoint's bank captions are tokenized once at start-up. The first text -> image request that ranks an image
scores the image against every bank caption through the retrieval head's batcher (one row per caption, batched
like any other pairs) and keeps the prior, keyed by the image id (a hash of the image), in a bounded LRU; later
requests read it. Priors depend only on the model and the image, so each pod computes its own.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from models.query_bank import QueryBank, image_prior, normalised
from models.region_features import RegionFeatures
from models.tokenizer import VLTokenizer

Item = dict[str, np.ndarray]
# (bank token rows, image id, regions) -> the match scores of each row with the image
ScoreRows = Callable[[Sequence[Item], str, RegionFeatures], Awaitable[np.ndarray]]


class BankPriors:
    def __init__(self, bank: QueryBank, tokenizer: VLTokenizer, max_images: int = 100_000) -> None:
        if max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {max_images}")
        self.bank = bank
        self.rows: list[Item] = []
        for text in bank.texts:  # one row per caption, each only as long as its own word pieces
            encoded = tokenizer.encode([text])
            self.rows.append({name: value[0] for name, value in encoded.items()})
        self.max_images = max_images
        self._priors: OrderedDict[str, float] = OrderedDict()
        self.computed = 0  # priors computed (misses)

    def __len__(self) -> int:
        return len(self._priors)

    async def priors(self, images: Sequence[tuple[str, RegionFeatures]], score_rows: ScoreRows) -> np.ndarray:
        """(len(images),) priors, computing those of images not seen yet (each distinct image once)."""
        out = np.empty(len(images), np.float64)
        for n, (image_id, rf) in enumerate(images):
            prior = self._priors.get(image_id)
            if prior is None:
                prior = float(image_prior(await score_rows(self.rows, image_id, rf), self.bank.temperature))
                self.computed += 1
                self._priors[image_id] = prior
                while len(self._priors) > self.max_images:
                    self._priors.popitem(last=False)
            else:
                self._priors.move_to_end(image_id)
            out[n] = prior
        return out

    def normalise(self, scores: np.ndarray, priors: np.ndarray) -> np.ndarray:
        return normalised(scores, priors, self.bank.temperature)
