"""`explain=true`: where the model looked. The attention of the asked text's tokens over the image's regions, per
layer and head (models.attention, the same function the grounding analysis reads), bounded in size.

An explained request runs alone, outside its task's batcher (one runtime pass that keeps the attention, on the
inference thread); requests without explain never pay for it. Heads come best first when the checkpoint carries a
grounding analysis (`vlserve analyze grounding`: its report as `grounding.json` in the checkpoint directory, or
under the manifest's `grounding` key), ranked by entity-grounding accuracy; otherwise in layer, head order.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np

from models.region_features import RegionFeatures
from models.tokenizer import VLTokenizer

from .collate import pad_and_stack
from .runtime.base import Runtime

log = logging.getLogger("vlserve.explain")

MAX_HEADS = 48  # heads per explanation, best ranked first (every head of a 4-layer, 12-head encoder)
DECIMALS = 3  # attention weights are rounded to this many decimals (each is in [0, 1])

Item = dict[str, np.ndarray]


def grounding_report(checkpoint: Any) -> dict[str, Any] | None:
    """The grounding analysis a checkpoint carries (manifest key `grounding`, or grounding.json beside its weights)."""
    report = (getattr(checkpoint, "manifest", None) or {}).get("grounding")
    path = getattr(checkpoint, "path", None)
    if report is None and path is not None and (Path(path) / "grounding.json").is_file():
        try:
            report = json.loads((Path(path) / "grounding.json").read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s/grounding.json: %s", path, exc)
    return report if isinstance(report, dict) else None


def head_ranking(report: dict[str, Any] | None) -> tuple[int, int, list[tuple[int, int]]] | None:
    """(layers, heads per layer, every (layer, head) from 0, best entity grounding first) of a grounding report."""
    try:
        layers, per_layer = int(report["layers"]), int(report["heads_per_layer"])
        heads = sorted(report["heads"], key=lambda h: -float(h["entity"]))  # stable: ties keep layer, head order
        order = [(int(h["layer"]) - 1, int(h["head"]) - 1) for h in heads]
    except (KeyError, TypeError, ValueError):
        return None
    if sorted(order) != [(l, h) for l in range(layers) for h in range(per_layer)]:
        return None
    return layers, per_layer, order


class Explainer:
    """Runs explained requests on the runtime and shapes their attention into the response's `explain` entries."""

    def __init__(self, runtime: Runtime, executor: Executor, tokenizer: VLTokenizer, layer_kind: str,
                 report: dict[str, Any] | None = None, max_heads: int = MAX_HEADS):
        self.runtime = runtime
        self.executor = executor  # the inference thread: explained passes run between batches, never beside one
        self.layer_kind = layer_kind
        self.ranking = head_ranking(report) if report is not None else None
        self.max_heads = max_heads
        self.token_of = {i: token for token, i in tokenizer.vocab.items()}

    async def run(self, task: str, item: Item) -> tuple[np.ndarray, list[np.ndarray], float]:
        """(logits of the one example, per image (L, heads, T, N) attention, seconds the pass took)."""
        batch = pad_and_stack([item])
        loop = asyncio.get_running_loop()

        def explain() -> tuple[np.ndarray, list[np.ndarray], float]:
            started = time.perf_counter()
            logits, attention = self.runtime.explain(task, batch)
            return logits[0], attention, time.perf_counter() - started

        return await loop.run_in_executor(self.executor, explain)

    def order(self, layers: int, heads: int) -> tuple[list[tuple[int, int]], str]:
        """The heads to answer, best first, and what ranked them."""
        if self.ranking is not None and self.ranking[:2] == (layers, heads):
            return self.ranking[2][: self.max_heads], "grounding"
        return [(l, h) for l in range(layers) for h in range(heads)][: self.max_heads], "layer"

    def describe(self, attention: np.ndarray, text: str, input_ids: np.ndarray, image_id: str,
                 rf: RegionFeatures) -> dict[str, Any]:
        """One `explain` entry: attention (L, heads, T, N) of `text` (its input_ids) over the regions of `image_id`."""
        layers, heads = attention.shape[:2]
        tokens = [self.token_of.get(int(i), "[UNK]") for i in input_ids]
        order, ranked_by = self.order(layers, heads)
        weights = np.round(attention[:, :, : len(tokens), : rf.num_boxes].astype(np.float64), DECIMALS)
        return {
            "text": text,
            "image_id": image_id,
            "tokens": tokens,
            "regions": list(range(rf.num_boxes)),
            "boxes": [[round(float(v), 2) for v in box] for box in rf.boxes[: rf.num_boxes]],
            "image_size": [int(v) for v in rf.image_hw],
            "layer_kind": self.layer_kind,
            "layers": int(layers),
            "heads_per_layer": int(heads),
            "ranked_by": ranked_by,
            "attention": [{"layer": l + 1, "head": h + 1, "weights": weights[l, h].tolist()} for l, h in order],
        }


def real_ids(item: Item) -> np.ndarray:
    """The input ids of an item's real tokens."""
    return item["input_ids"][np.asarray(item["attention_mask"]) != 0]


def explain_pairs(explainer: Explainer, attention: Sequence[np.ndarray], text: str, item: Item,
                  images: Sequence[tuple[str, RegionFeatures]]) -> list[dict[str, Any]]:
    """The entries of one text over each of its images (two for NLVR2)."""
    ids = real_ids(item)
    return [explainer.describe(a, text, ids, image_id, rf) for a, (image_id, rf) in zip(attention, images)]
