"""RoIAlign whose backward is fast on CPU, for training the region detector.

torchvision's CPU `roi_align` backward is a single-threaded scalar loop (~38% of a CPU detector training step).
`roi_align` here returns the same numbers as `torchvision.ops.roi_align` for `sampling_ratio > 0`, computed with
matrix products, so autograd's backward is matrix products too (multi-threaded, vectorised).

Why matrix products: torchvision's bin value is separable. Bin (i, j) of a RoI averages s x s bilinear samples at
(y_i,a, x_j,b), y_i,a = start_y + (i + (a + 0.5) / s) * bin_h (x alike; s = sampling_ratio); a bilinear sample is
sum_h sum_w wy(y, h) wx(x, w) F[h, w]; torchvision zeroes a sample with y < -1 or y > height or x < -1 or x > width
(a product of a y and an x indicator) and clamps y to [0, height - 1] (x alike). So with
Ay[i, h] = mean_a valid(y_i,a) wy(clamp(y_i,a), h) and Ax alike, bin (i, j) = (Ay F Ax^T)[i, j]: per image one
(K*7, H) @ (H, C*W) product, then per RoI a (7*C, W) @ (W, 7) one. (grid_sample at the s x s sample points then a
2 x 2 mean, the other vectorised route, is several times slower than this at the detector's shapes: it
materialises and pools 4x the output, forward and backward; benchmarks/roi_align.py times all three.)

`TrainingRoIAlign` is torchvision's MultiScaleRoIAlign that pools with `roi_align` when autograd needs gradients
w.r.t. CPU features; otherwise (inference, no_grad, CUDA) it is torchvision's module unchanged.
"""
from __future__ import annotations

import torch
import torchvision
from torch import Tensor
from torchvision.ops import MultiScaleRoIAlign
from torchvision.ops import roi_align as tv_roi_align
# private torchvision helpers: (K, 5) RoI rows; per-level scales + the FPN LevelMapper, as MultiScaleRoIAlign sets them
from torchvision.ops.poolers import _convert_to_roi_format, _setup_scales


def roi_align(input: Tensor, boxes: Tensor | list[Tensor], output_size: int | tuple[int, int],
              spatial_scale: float = 1.0, sampling_ratio: int = -1, aligned: bool = False) -> Tensor:
    """`torchvision.ops.roi_align` (same arguments, same result) as matrix products.

    boxes: (K, 5) rows (batch index, x1, y1, x2, y2) or one (Ki, 4) tensor per image. As with torchvision's, no
    gradient flows to the boxes. sampling_ratio <= 0 (a sample count per RoI) falls back to torchvision's op.
    """
    ph, pw = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    if sampling_ratio <= 0:
        return tv_roi_align(input, boxes, (ph, pw), spatial_scale, sampling_ratio, aligned)
    rois = boxes if isinstance(boxes, Tensor) else _convert_to_roi_format(boxes)
    rois = rois.detach().to(torch.float64)  # sample positions and weights in float64, cast once at the end
    n, c, h, w = input.shape
    k = rois.shape[0]
    if k == 0:
        return input[:0, :, :1, :1].expand(0, c, ph, pw)

    offset = 0.5 if aligned else 0.0
    x1, y1, x2, y2 = (rois[:, i] * spatial_scale - offset for i in range(1, 5))
    roi_w, roi_h = x2 - x1, y2 - y1
    if not aligned:
        roi_w, roi_h = roi_w.clamp(min=1.0), roi_h.clamp(min=1.0)
    ay = axis_weights(y1, roi_h, ph, sampling_ratio, h).to(input.dtype)  # (K, ph, H)
    ax = axis_weights(x1, roi_w, pw, sampling_ratio, w).to(input.dtype).transpose(1, 2)  # (K, W, pw)

    batch = rois[:, 0].long()
    order = None
    if k > 1 and bool((batch[1:] < batch[:-1]).any()):  # MultiScaleRoIAlign's rows come sorted by image already
        order = torch.argsort(batch, stable=True)
        batch, ay, ax = batch[order], ay[order], ax[order]
    counts = torch.bincount(batch, minlength=n).tolist()
    pooled, start = [], 0
    for b, kb in enumerate(counts):
        if kb == 0:
            continue
        rows = slice(start, start + kb)
        start += kb
        feat = input[b].transpose(0, 1).reshape(h, c * w)  # (H, C*W)
        along_y = (ay[rows].reshape(kb * ph, h) @ feat).view(kb, ph * c, w)  # (Kb, ph*C, W)
        out = torch.bmm(along_y, ax[rows])  # (Kb, ph*C, pw)
        pooled.append(out.view(kb, ph, c, pw).transpose(1, 2))
    result = torch.cat(pooled)  # (K, C, ph, pw)
    if order is not None:
        result = result[torch.argsort(order)]
    return result


def axis_weights(start: Tensor, size: Tensor, bins: int, samples: int, length: int) -> Tensor:
    """(K, bins, length): row i = the mean, over bin i's samples along this axis, of torchvision's bilinear weights
    (0 for a sample beyond [-1, length], else clamped to [0, length - 1] and split between its two neighbours)."""
    bin_size = (size / bins)[:, None, None]
    index = torch.arange(bins, dtype=start.dtype, device=start.device)[None, :, None]
    within = (torch.arange(samples, dtype=start.dtype, device=start.device) + 0.5)[None, None, :]
    pos = start[:, None, None] + index * bin_size + within * bin_size / samples  # (K, bins, samples), as torchvision
    keep = ((pos >= -1.0) & (pos <= length)).to(pos.dtype) / samples
    pos = pos.clamp(0.0, length - 1.0)
    low = pos.floor()
    frac = pos - low
    low = low.long()
    high = (low + 1).clamp(max=length - 1)
    weights = pos.new_zeros((start.shape[0], bins, length))
    weights.scatter_add_(2, low, (1.0 - frac) * keep)
    weights.scatter_add_(2, high, frac * keep)
    return weights


class TrainingRoIAlign(MultiScaleRoIAlign):
    """torchvision's MultiScaleRoIAlign (same levels, scales and outputs; no parameters or buffers, so the same
    state_dict) pooling with `roi_align` above when autograd needs gradients w.r.t. CPU features."""

    def forward(self, x: dict[str, Tensor], boxes: list[Tensor], image_shapes: list[tuple[int, int]]) -> Tensor:
        feats = [v for k, v in x.items() if k in self.featmap_names]  # as torchvision's _filter_input
        needs_grad = torch.is_grad_enabled() and any(f.requires_grad and f.device.type == "cpu" for f in feats)
        if not needs_grad or torch.jit.is_scripting() or torchvision._is_tracing():
            return super().forward(x, boxes, image_shapes)
        if self.scales is None or self.map_levels is None:
            self.scales, self.map_levels = _setup_scales(feats, image_shapes, self.canonical_scale,
                                                         self.canonical_level)
        # torchvision's _multiscale_roi_align with its roi_align swapped for ours (tracing/ONNX branch dropped)
        rois = _convert_to_roi_format(boxes)
        if len(feats) == 1:
            return roi_align(feats[0], rois, self.output_size, self.scales[0], self.sampling_ratio)
        levels = self.map_levels(boxes)
        if levels.numel() and bool((levels == levels[0]).all()):  # one level (all of them at 128 px): no scatter
            level = int(levels[0])
            return roi_align(feats[level], rois, self.output_size, self.scales[level], self.sampling_ratio).to(
                feats[0].dtype)
        result = feats[0].new_zeros((rois.shape[0], feats[0].shape[1], *self.output_size))
        for level, (feature, scale) in enumerate(zip(feats, self.scales)):
            idx = torch.where(levels == level)[0]
            result[idx] = roi_align(feature, rois[idx], self.output_size, scale, self.sampling_ratio).to(result.dtype)
        return result
