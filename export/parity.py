"""Parity of an exported graph with the torch model: max abs logit difference and top-1 agreement.

Batches are synthetic but shaped like the service's (export/encoder.py synthetic_batch) at sizes other than
the export sizes (batch 2, 8 tokens, 6 regions): batch 1 and odd batches, short and long texts, few and many
regions, every batch right-padded. No text is longer than the encoder's position table places (its
text_positions; imported checkpoints may have as few as 20).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from models import VLModel
from models.repository import GraphSpec, graph_feed

from .encoder import synthetic_batch, to_torch

MAX_ABS_DIFF = 1e-4  # fp32 logits: an exported graph further from torch than this fails the export
MIN_AGREEMENT = 0.995  # share of examples whose top-1 (answer, box, match, choice) equals torch's
# int8: a guard against a broken quantization (which agrees about as often as chance), not the accuracy bound.
# Near-tied scores flip under int8 without changing accuracy: the demo model set's refer head agreed on 77% of
# the synthetic batches (82% of the held-out set) while losing 0.36 points. The accuracy change itself
# (allowed: 0.5 points) needs labelled data: benchmarks/exported_accuracy.py measures it.
MIN_INT8_AGREEMENT = 0.5
# fp16 (ONNX graphs for the CUDA execution provider, TensorRT engines): fp16 rounds every activation to ~3
# significant digits, so logits move by ~1e-3 relative; a broken conversion moves them by far more.
FP16_MAX_ABS_DIFF = 5e-2
FP16_MIN_AGREEMENT = 0.99
# (batch, text length, regions) of the shape-checking batches; none equals the export sizes
SHAPES = ((1, 5, 3), (3, 13, 10), (5, 21, 4), (7, 9, 17))
TEXT_CYCLE, REGION_CYCLE = (8, 24), (4, 33)  # later batches: text 8 + (i*5) % 24, regions 4 + (i*7) % 33
MEASURED_TEXT = TEXT_CYCLE[0] + TEXT_CYCLE[1] - 1  # the longest text of any parity batch (31), unless capped
MEASURED_REGIONS = REGION_CYCLE[0] + REGION_CYCLE[1] - 1  # the most regions of any parity batch (36)


@dataclass
class Parity:
    max_abs_diff: float  # over every logit finite in both the graph's and torch's output, of every batch
    agreement: float  # top-1 agreement with torch over `examples`; a row with a `nonfinite` logit disagrees
    examples: int
    shapes: list[list[int]]  # (batch, text, regions) of the batches measured
    nonfinite: int = 0  # logits that are NaN or infinite in one output and not the same in the other

    def to_dict(self) -> dict:
        return asdict(self)


def top1(logits: np.ndarray) -> np.ndarray:
    """Top-1 index per example along the last axis (refer: region, vqa: answer, itm/nlvr2: class)."""
    return logits.reshape(-1, logits.shape[-1]).argmax(-1)


def nonfinite_mismatch(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Where one output is NaN or infinite and the other is not the same value (NaN where torch has NaN, or the
    same infinity, is a match): a difference no absolute bound measures, since NaN compares false with any."""
    finite_got, finite_expected = np.isfinite(got), np.isfinite(expected)
    same = (got == expected) | (np.isnan(got) & np.isnan(expected))
    return ~(finite_got & finite_expected) & ~same


def torch_logits(model: VLModel, task: str, feed: dict[str, np.ndarray]) -> np.ndarray:
    with torch.inference_mode():
        return model(to_torch(feed), task).logits.float().numpy()


def measured_text(text_positions: int) -> int:
    """The longest text of any parity batch of an encoder whose position table places `text_positions` tokens."""
    return min(MEASURED_TEXT, text_positions)


def parity_shapes(examples: int, text_positions: int = MEASURED_TEXT) -> list[tuple[int, int, int]]:
    """(batch, text length, regions) of the parity batches: the SHAPES, then batches of 32 up to `examples`;
    texts at most measured_text(text_positions) long."""
    shapes = list(SHAPES)
    total = sum(s[0] for s in shapes)
    while total < examples:
        b = min(32, examples - total)
        i = len(shapes)
        shapes.append((b, TEXT_CYCLE[0] + (i * 5) % TEXT_CYCLE[1], REGION_CYCLE[0] + (i * 7) % REGION_CYCLE[1]))
        total += b
    longest = measured_text(text_positions)
    return [(b, min(t, longest), n) for b, t, n in shapes]


def parity_batches(model: VLModel, task: str, examples: int, seed: int = 0):
    """(shape, feed, torch logits) of each of the parity_shapes(examples) batches for `model`'s position table."""
    for i, (b, t, n) in enumerate(parity_shapes(examples, model.config.encoder.text_positions)):
        feed = synthetic_batch(model.config, task, batch=b, text_len=t, regions=n, seed=seed + i)
        if "image_feature" not in feed:  # torch is given what the service gives it where its detector has a
            # whole-image feature: a graph without that input must answer as torch does with it
            rng = np.random.default_rng(seed + i)
            feed["image_feature"] = np.abs(rng.standard_normal(feed["region_features"].shape[:-2]
                                                               + feed["region_features"].shape[-1:])).astype(np.float32)
        yield (b, t, n), feed, torch_logits(model, task, feed)


def measure(model: VLModel, spec: GraphSpec, run, examples: int = 1000, seed: int = 0, reference=None) -> Parity:
    """Parity of `run(feed) -> logits` with the torch model (or with `reference(feed)` when given). The largest
    difference is taken over the logits finite in both outputs; the others, NaN or infinite on one side only, are
    counted in `nonfinite` (a failure whatever the bounds) and their rows count as disagreeing."""
    worst, agree, count, nonfinite, shapes = 0.0, 0, 0, 0, []
    for shape, feed, expected in parity_batches(model, spec.task, examples, seed):
        if reference is not None:
            expected = reference(feed)
        got = run(graph_feed(spec, feed))  # the inputs the graph kept
        if got.shape != expected.shape:
            raise ValueError(f"graph {spec.task!r}: logits of shape {got.shape}, torch gives {expected.shape} "
                             f"(batch, text, regions = {shape})")
        got, expected = got.astype(np.float64), expected.astype(np.float64)
        mismatch = nonfinite_mismatch(got, expected)
        both_finite = np.isfinite(got) & np.isfinite(expected)
        if both_finite.any():
            worst = max(worst, float(np.abs(got[both_finite] - expected[both_finite]).max()))
        nonfinite += int(mismatch.sum())
        rows = mismatch.reshape(-1, got.shape[-1]).any(-1)
        a, e = top1(got), top1(expected)
        agree += int(((a == e) & ~rows).sum())
        count += a.size
        shapes.append(list(shape))
    return Parity(max_abs_diff=worst, agreement=agree / max(count, 1), examples=count, shapes=shapes,
                  nonfinite=nonfinite)
