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
from torchvision.ops import clip_boxes_to_image

from .config import DetectorConfig


@dataclass
class Prepared:
    tensor: torch.Tensor  # (3, Hc, Wc) normalised, zero-padded canvas
    resized_hw: tuple[int, int]  # image size after resizing, inside the canvas
    scale: float  # resized / original
    original_hw: tuple[int, int]
    box_scale: tuple[float, float] | None = None  # "detectron2" resize: original / resized per axis (x, y)

    def to_original(self, boxes: torch.Tensor) -> torch.Tensor:
        """(k, 4) boxes in resized-image pixels -> original-image pixels, clipped to the image."""
        if self.box_scale is None:
            boxes = boxes / self.scale
        else:  # rounding the resized size makes x and y scales differ slightly; each axis keeps its own
            sx, sy = self.box_scale
            boxes = boxes * boxes.new_tensor([sx, sy, sx, sy])
        return clip_boxes_to_image(boxes, self.original_hw)


def resize_scale(h: int, w: int, min_size: int, max_size: int) -> float:
    """Scale so the shorter side is min_size unless that makes the longer side exceed max_size."""
    return min(min_size / min(h, w), max_size / max(h, w))


# The smallest canvas side the detectron2-family backbone runs on: ResNet C4's coarsest stride (res4's). Below it
# the stem's max pool has no input left (a 10000 x 20 strip resized to 1000 x 2: the reference fails there); a
# canvas that small is padded up to it, which no image the reference can run needs.
MIN_CANVAS_SIDE = 16


def detectron2_size(h: int, w: int, min_size: int, max_size: int) -> tuple[int, int]:
    """detectron2's test-time ResizeShortestEdge, in its float steps: the shorter side to min_size, then both sides
    shrunk together if the longer exceeds max_size, each rounded half up (bottom-up attention's frcnn-vg port); a
    side never below one pixel (where the port's would round to none)."""
    short = float(min_size)
    if h < w:
        rh, rw = short, short / h * w
    else:
        rh, rw = short / w * h, short
    longer = max(rh, rw)
    if longer > max_size:
        rh, rw = rh * (max_size / longer), rw * (max_size / longer)
    return max(1, int(rh + 0.5)), max(1, int(rw + 0.5))


def decode_side(cfg: DetectorConfig) -> int | None:
    """Longest image side worth decoding for this detector: twice the longest side it resizes to (max_size), or
    None (decode at full size) for a detector whose resize is plain bilinear ("detectron2", the bottom-up-attention
    family): it samples the full image, so any reduction beforehand would change what it sees and its regions would
    no longer equal its reference's.

    An image reduced to it (aspect ratio kept) is still at least as large as the detector's resize of the full
    image on both sides, and the detector's own antialiased resize still shrinks it by 2x or more, so the two
    resizes low-pass much as one does; images that fit are not touched.
    """
    return None if cfg.resize == "detectron2" else 2 * cfg.max_size


def prepare_image(image: np.ndarray, cfg: DetectorConfig) -> Prepared:
    """(H, W, 3) uint8 RGB -> normalised tensor on its own canvas."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected an (H, W, 3) uint8 RGB image, got {image.dtype} {image.shape}")
    if cfg.resize == "detectron2":
        return _prepare_detectron2(image, cfg)
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


def _prepare_detectron2(image: np.ndarray, cfg: DetectorConfig) -> Prepared:
    """Caffe-style input as detectron2 ports feed it: pixels in [0, pixel_range] in the model's colour order,
    resized (plain bilinear on the float image), mean subtracted, divided by std, padded only where a side is below
    MIN_CANVAS_SIDE (or size_divisible asks for it)."""
    h, w = image.shape[:2]
    rh, rw = detectron2_size(h, w, cfg.min_size, cfg.max_size)
    x = torch.from_numpy(image if image.flags.writeable else image.copy())  # (H, W, 3)
    if cfg.channel_order == "BGR":
        x = x.flip(-1)
    x = x.float()
    if cfg.pixel_range != 255.0:
        x = x.div_(255.0 / cfg.pixel_range)
    # resized from the (H, W, 3) layout as a channels-last (1, 3, H, W) view, the layout detectron2's float path
    # resizes in: its bilinear kernel, and so its rounding, is that layout's
    x = F.interpolate(x.permute(2, 0, 1)[None], size=(rh, rw), mode="bilinear", align_corners=False)[0]
    mean = torch.tensor(cfg.mean).view(3, 1, 1)
    std = torch.tensor(cfg.std).view(3, 1, 1)
    x = ((x - mean) / std).contiguous()  # (3, rh, rw)
    d = cfg.size_divisible
    ch, cw = (max(MIN_CANVAS_SIDE, math.ceil(side / d) * d) for side in (rh, rw))
    canvas = F.pad(x, (0, cw - rw, 0, ch - rh)) if (ch, cw) != (rh, rw) else x
    # boxes go back to the original image per axis, as float32 original / resized (the reference's scales_yx)
    sx, sy = (float(np.float32(a) / np.float32(b)) for a, b in ((w, rw), (h, rh)))
    return Prepared(canvas, (rh, rw), min(rh / h, rw / w), (h, w), box_scale=(sx, sy))


def group_by_canvas(prepared: list[Prepared]) -> dict[tuple[int, int], list[int]]:
    """Indices of the images that share each canvas size (one detector batch per group)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(prepared):
        groups.setdefault(tuple(p.tensor.shape[1:]), []).append(i)
    return groups
