"""Two-stream retrieval cache: each image's and each text's single-modality encoder states, in-process.

For ViLBERT and LXMERT a text and an image meet only in the fusion layers, so /retrieve encodes the query
text once, every registered image once (per model and detector), and runs only the fusion layers per pair.
States are opaque objects of the runtime (torch tensors) with an `nbytes` attribute; the LRU is bounded by
their bytes. It lives in the process (one per model set), never in Redis: states are large and backend-made.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from models.region_features import RegionFeatures

from .collate import pad_and_stack

Item = dict[str, np.ndarray]  # one row of arrays, no batch axis
Encode = Callable[[dict[str, np.ndarray]], list[Any]]  # padded batch -> one state per row
S = TypeVar("S")  # what a side's input is before it becomes arrays


@dataclass(frozen=True)
class Pair:
    """One (text, image) candidate of a retrieval request: each side by its cache key and its inputs."""

    text_key: Hashable
    text: Item  # input_ids, attention_mask, token_type_ids (T,)
    image_key: Hashable
    image: RegionFeatures  # made into encoder arrays only when its states are not cached


class StreamCache:
    """LRU of per-row stream states keyed by model + detector fingerprint + image_id (images) or token ids (texts).

    Thread-safe: the encoder thread reads and fills it, /metrics reads its counters. Hits and misses are
    counted per side, once per distinct key of a batch.
    """

    def __init__(self, max_bytes: int, model: str, detector: str) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.model = model
        self.detector = detector
        self.hits = {"text": 0, "image": 0}
        self.misses = {"text": 0, "image": 0}
        self.evictions = 0
        self._bytes = 0
        self._values: OrderedDict[Hashable, Any] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    # ---- keys ----

    def image_key(self, image_id: str) -> Hashable:
        return ("image", self.model, self.detector, image_id)

    def text_key(self, text: Item) -> Hashable:
        """The token ids and segments decide the text stream (the mask follows from them)."""
        digest = hashlib.blake2b(digest_size=16)
        for name in ("input_ids", "token_type_ids"):
            digest.update(np.ascontiguousarray(text[name], dtype=np.int64).tobytes())
            digest.update(b"|")
        return ("text", self.model, digest.hexdigest())

    def pair(self, text_key: Hashable, text: Item, image_id: str, image: RegionFeatures) -> Pair:
        return Pair(text_key, text, self.image_key(image_id), image)

    # ---- values ----

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._values)

    def fetch(self, side: str, requests: Sequence[tuple[Hashable, S]], encode: Encode,
              arrays: Callable[[S], Item] = lambda item: item) -> list[Any]:
        """The state of each (key, input): cached, else encoded (the misses' `arrays` in one padded batch) and kept."""
        found: dict[Hashable, Any] = {}
        missing: dict[Hashable, S] = {}
        with self._lock:
            for key, source in requests:
                if key in found or key in missing:
                    continue
                value = self._values.get(key)
                if value is None:
                    missing[key] = source
                else:
                    self._values.move_to_end(key)
                    found[key] = value
            self.hits[side] += len(found)
            self.misses[side] += len(missing)
        if missing:
            states = encode(pad_and_stack([arrays(source) for source in missing.values()]))
            if len(states) != len(missing):
                raise RuntimeError(f"{side} encoder returned {len(states)} states for {len(missing)} rows")
            for key, state in zip(missing, states):
                found[key] = state
                self._put(key, state)
        return [found[key] for key, _ in requests]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"items": len(self._values), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "hits": dict(self.hits), "misses": dict(self.misses), "evictions": self.evictions}

    def _put(self, key: Hashable, value: Any) -> None:
        size = int(value.nbytes)
        if size > self.max_bytes:
            return  # larger than the whole cache: used for this batch, not kept
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self._bytes -= int(old.nbytes)
            while self._bytes + size > self.max_bytes:
                _, evicted = self._values.popitem(last=False)
                self._bytes -= int(evicted.nbytes)
                self.evictions += 1
            self._values[key] = value
            self._bytes += size
