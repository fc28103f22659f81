"""Deterministic detector preprocessing: resize, normalise, pad to a canvas that depends on the image alone.

Because an image's canvas never depends on the other images in its batch, images are batched per canvas
size and batched extraction equals per-image extraction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .config import DetectorConfig


@dataclass
class Prepared:
    tensor: torch.Tensor  # (3, Hc, Wc) normalised, zero-padded canvas
    resized_hw: tuple[int, int]  # image size after resizing, inside the canvas
    scale: float  # resized / original
    original_hw: tuple[int, int]


def resize_scale(h: int, w: int, min_size: int, max_size: int) -> float:
    """Scale so the shorter side is min_size unless that makes the longer side exceed max_size."""
    return min(min_size / min(h, w), max_size / max(h, w))


def decode_side(cfg: DetectorConfig) -> int:
    """Longest image side worth decoding for this detector: twice the longest side it resizes to (max_size).

    An image reduced to it (aspect ratio kept) is still at least as large as the detector's resize of the full
    image on both sides, and the detector's own antialiased resize still shrinks it by 2x or more, so the two
    resizes low-pass much as one does; images that fit are not touched.
    """
    return 2 * cfg.max_size


def prepare_image(image: np.ndarray, cfg: DetectorConfig) -> Prepared:
    """(H, W, 3) uint8 RGB -> normalised tensor on its own canvas."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected an (H, W, 3) uint8 RGB image, got {image.dtype} {image.shape}")
    h, w = image.shape[:2]
    scale = resize_scale(h, w, cfg.min_size, cfg.max_size)
    rh, rw = max(1, round(h * scale)), max(1, round(w * scale))
    x = torch.from_numpy(image if image.flags.writeable else image.copy()).permute(2, 0, 1).float().div_(255.0)  # (3, H, W)
    if (rh, rw) != (h, w):
        x = F.interpolate(x[None], size=(rh, rw), mode="bilinear", align_corners=False, antialias=scale < 1)[0]
    mean = torch.tensor(cfg.mean).view(3, 1, 1)
    std = torch.tensor(cfg.std).view(3, 1, 1)
    x = (x - mean) / std
    d = cfg.size_divisible
    ch, cw = math.ceil(rh / d) * d, math.ceil(rw / d) * d
    canvas = F.pad(x, (0, cw - rw, 0, ch - rh))  # zeros = the mean colour after normalisation
    return Prepared(canvas, (rh, rw), scale, (h, w))


def group_by_canvas(prepared: list[Prepared]) -> dict[tuple[int, int], list[int]]:
    """Indices of the images that share each canvas size (one detector batch per group)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(prepared):
        groups.setdefault(tuple(p.tensor.shape[1:]), []).append(i)
    return groups
