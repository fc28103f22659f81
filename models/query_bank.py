"""Query-bank normalisation of text -> image retrieval scores (an inverted softmax: Smith et al. 2017, "Offline
bilingual word vectors..."; Bogolin et al. 2022, "Cross Modal Retrieval with Querybank Normalisation").

A cross-encoder's match scores are not comparable across images: some images ("hubs") score high with every
caption and top the ranking of many queries. Each image is scored once against a fixed bank of captions from the
training data; a query's score s with that image becomes the log of its share of exp(s / T) among exp(b / T) over
the bank's scores b with the same image and exp(s / T) itself:

    normalised(s) = s / T - log(exp(prior) + exp(s / T)),  prior = logsumexp(b / T over the bank)

so an image that matches every bank caption well needs a better score to rank first. The ranking of captions for
one image (image -> text) is unchanged: normalised(s) grows with s for a fixed image.

The bank travels in the checkpoint's labels.json under BANK_KEY: {"texts": [...], "temperature": T}.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

BANK_KEY = "retrieval_bank"


@dataclass(frozen=True)
class QueryBank:
    texts: tuple[str, ...]  # captions of the training data, none of them an evaluation query
    temperature: float

    def __post_init__(self) -> None:
        if not self.texts or not all(isinstance(t, str) and t.strip() for t in self.texts):
            raise ValueError("a query bank needs at least one caption, each a non-empty string")
        if not (isinstance(self.temperature, (int, float)) and np.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"a query bank's temperature must be a positive number, got {self.temperature!r}")

    def to_labels(self) -> dict[str, Any]:
        return {"texts": list(self.texts), "temperature": float(self.temperature)}

    @classmethod
    def from_labels(cls, labels: Mapping[str, Any]) -> QueryBank | None:
        """The bank of a checkpoint's labels; None where it has none; ValueError naming what is wrong."""
        entry = labels.get(BANK_KEY)
        if entry is None:
            return None
        if not isinstance(entry, Mapping) or not isinstance(entry.get("texts"), list):
            raise ValueError(f"{BANK_KEY} must be an object with a list of texts and a temperature")
        return cls(tuple(entry["texts"]), entry.get("temperature", 1.0))


def image_prior(bank_scores: np.ndarray, temperature: float) -> np.ndarray:
    """logsumexp over the bank (axis 0) of bank scores / T: (B,) -> scalar, (B, N) -> (N,) one per image."""
    scaled = np.asarray(bank_scores, np.float64) / temperature
    top = scaled.max(axis=0)
    return top + np.log(np.exp(scaled - top).sum(axis=0))


def normalised(scores: np.ndarray, prior: np.ndarray, temperature: float) -> np.ndarray:
    """Query-bank normalised scores: (..., N) raw scores with images' priors (N,) -> log shares, each <= 0."""
    scaled = np.asarray(scores, np.float64) / temperature
    return scaled - np.logaddexp(np.asarray(prior, np.float64), scaled)
