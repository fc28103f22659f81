"""RoIPool (caffe's, as torchvision.ops.roi_pool computes it) as one gather from rectangle-maximum tables.

torchvision's CPU kernel loops over every (region, channel, bin) on one thread, in float32 only, and writes NCHW; the
serving form of the butd detector (channels-last res5, bfloat16 where the CPU has it) would then pay for a zero fill
and a layout and dtype copy too, about 0.5 s a photo at 300 proposals. Here, per image, tables
E[i][j][y, x] = max of the map over rows y .. y + i and columns x .. x + j (one elementwise maximum each, built
from the previous ones) hold every rectangle a bin can cover, so each bin is one row of a single gather of whole
channel vectors, in the map's own dtype, straight into the (R, C, S, S) channels-last layout res5 reads; empty bins
read an appended zero row. A bin spans at most ceil(map side / S) + 1 cells per axis (6 x 6 for a 1000 px image at
stride 16 and S = 14: 36 tables of the map); beyond MAX_EXTENT, torchvision's kernel runs instead.

Maxima are exact in any dtype and the bins come from the kernel's own float32 arithmetic (C's round() of the scaled
box, float bin sizes, floor and ceil), so the result equals torchvision's roi_pool bit for bit (tested) on the
CPU. A GPU runs torchvision's kernel, parallel there (docs/BENCHMARKS.md, "on a GPU": the bins computed on CUDA came
out otherwise).
"""
from __future__ import annotations

import torch
from torchvision.ops import roi_pool

MAX_EXTENT = 8  # cells per bin and axis beyond which the tables (MAX_EXTENT^2 maps) cost more than they save


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's round(): halves away from zero (torch.round rounds them to even)."""
    a = v.abs()
    whole = a.floor()
    return torch.sign(v) * (whole + (a - whole >= 0.5).to(v.dtype))


def _bins(start: torch.Tensor, end: torch.Tensor, size: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, size) first and one-past-last cells of each bin along one axis, clipped to [0, limit]."""
    length = (end - start + 1).clamp(min=1).float()
    bin_size = length / size  # float32, as the kernel's static_cast<T>(roi_len) / static_cast<T>(pooled)
    steps = torch.arange(size + 1, dtype=torch.float32, device=start.device)
    lo = (steps[None, :-1] * bin_size[:, None]).floor().long() + start[:, None]
    hi = (steps[None, 1:] * bin_size[:, None]).ceil().long() + start[:, None]
    return lo.clamp(0, limit), hi.clamp(0, limit)


def _tables(image: torch.Tensor, extent_h: int, extent_w: int) -> torch.Tensor:
    """(extent_h extent_w H W + 1, C) rows: E[i][j][y, x] (i < extent_h, j < extent_w) as defined in the module
    docstring, then a zero row. Cells whose rectangle runs past the map are never read."""
    h, w, c = image.shape
    out = image.new_empty((extent_h, extent_w, h, w, c))
    out[0, 0] = image
    for j in range(1, extent_w):  # widen along x
        torch.maximum(out[0, j - 1, :, : w - j], image[:, j:], out=out[0, j, :, : w - j])
    for i in range(1, extent_h):  # then along y, every width at once
        torch.maximum(out[i - 1, :, : h - i], out[0, :, i:], out=out[i, :, : h - i])
    return torch.cat([out.view(-1, c), image.new_zeros((1, c))])


class ImageRoIPool:
    """RoIPool of one image's boxes, any subset at a time, for pooling the same map again and again
    (ButdRoIHeads.settle pools a few proposals per round). The bins of all boxes are computed once; a call reads
    the tables (module docstring, built for all boxes on first need) with one gather, or, while the tables are not
    built and the subset's bins cover fewer cells than building them would write, gathers every cell of its bins
    and takes each bin's maximum with one scatter (`_visit`: a round of 8 float32 proposals 1-5 ms against the
    kernel's 9-24, 2 cores; at most as many rows as the tables would hold)."""

    def __init__(self, features: torch.Tensor, boxes: torch.Tensor, size: int, scale: float):
        """features (C, H, W) of one image, best channels-last; boxes (R, 4) float32 x1, y1, x2, y2 in input
        pixels."""
        self.features, self.boxes, self.size, self.scale = features, boxes, size, scale
        self.table: torch.Tensor | None = None
        self.nchw: torch.Tensor | None = None  # the float32 NCHW map torchvision's kernel reads, made once
        # a GPU runs torchvision's kernel: parallel there, where the gather gave other maxima (docs/BENCHMARKS.md)
        self.gather = features.device.type == "cpu" and boxes.shape[0] > 0
        if not self.gather:
            return
        c, h, w = features.shape
        scaled = _round_half_away(boxes.float() * torch.tensor(scale, dtype=torch.float32)).long()
        ys, ye = _bins(scaled[:, 1], scaled[:, 3], size, h)  # (R, size)
        xs, xe = _bins(scaled[:, 0], scaled[:, 2], size, w)
        eh, ew = ye - ys, xe - xs
        self.ys, self.xs, self.eh, self.ew = ys, xs, eh.clamp(min=0), ew.clamp(min=0)  # (R, size): 0 for empty bins
        self.cells = self.eh.sum(1) * self.ew.sum(1)  # (R,) cells the kernel visits per box
        self.gather = int(eh.max()) <= MAX_EXTENT and int(ew.max()) <= MAX_EXTENT
        if not self.gather:  # bins too wide for the tables: torchvision's kernel instead
            return
        empty = (eh <= 0)[:, :, None] | (ew <= 0)[:, None, :]  # (R, size, size): zero, as the kernel gives
        self.extent = max(int(eh.max()), 1), max(int(ew.max()), 1)
        self.table_cells = self.extent[0] * self.extent[1] * h * w
        # row of bin (p, q) of box n: E[eh - 1][ew - 1][ys, xs]
        cell = (((eh.clamp(min=1) - 1)[:, :, None] * self.extent[1] + (ew.clamp(min=1) - 1)[:, None, :]) * h
                + ys.clamp(max=h - 1)[:, :, None]) * w + xs.clamp(max=w - 1)[:, None, :]
        self.cell = torch.where(empty, self.table_cells, cell)  # the zero row

    def __call__(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """(n, C, size, size) channels-last pooled maps of boxes[idx] (all boxes without idx), in the map's dtype."""
        c = self.features.shape[0]
        idx = torch.arange(self.boxes.shape[0], device=self.boxes.device) if idx is None else idx
        if self.gather and self.table is None and int(self.cells[idx].sum()) < self.table_cells:
            return self._visit(idx)
        if not self.gather:
            boxes = self.boxes[idx]
            rois = torch.cat([torch.zeros_like(boxes[:, :1]), boxes], dim=1).float()
            if self.nchw is None:
                self.nchw = self.features[None].float().contiguous()
            pooled = roi_pool(self.nchw, rois, self.size, self.scale)
            return pooled.to(dtype=self.features.dtype, memory_format=torch.channels_last)
        if self.table is None:
            self.table = _tables(self.features.permute(1, 2, 0), *self.extent)
        rows = self.table.index_select(0, self.cell[idx].reshape(-1))
        return rows.view(-1, self.size, self.size, c).permute(0, 3, 1, 2)

    def _visit(self, idx: torch.Tensor) -> torch.Tensor:
        """Pooled maps of boxes[idx] from the cells themselves: every cell of every bin gathered as one row (bin by
        bin, row-major within a bin), then each bin's maximum by a scatter; empty bins stay 0, as the kernel gives.
        Exact (a maximum of the same values)."""
        c, h, w = self.features.shape
        n, s = idx.shape[0], self.size
        eh, ew = self.eh[idx], self.ew[idx]  # (n, s)
        counts = (eh[:, :, None] * ew[:, None, :]).reshape(-1)  # (n s s,) cells per bin
        bins = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)  # bin per visit
        step = torch.arange(bins.shape[0], device=counts.device) - (counts.cumsum(0) - counts)[bins]  # within the bin
        width = ew[:, None, :].expand(n, s, s).reshape(-1)[bins]
        y = self.ys[idx][:, :, None].expand(n, s, s).reshape(-1)[bins] + step.div(width, rounding_mode="floor")
        x = self.xs[idx][:, None, :].expand(n, s, s).reshape(-1)[bins] + step % width
        rows = self.features.permute(1, 2, 0).reshape(h * w, c).index_select(0, y * w + x)
        out = rows.new_zeros((counts.shape[0], c)).scatter_reduce_(0, bins[:, None].expand(-1, c), rows, "amax",
                                                                  include_self=False)
        return out.view(n, s, s, c).permute(0, 3, 1, 2)


def roi_pool_channels_last(features: torch.Tensor, rois: torch.Tensor, size: int, scale: float) -> torch.Tensor:
    """torchvision.ops.roi_pool(features, rois, size, scale) for any floating dtype, as a channels-last
    (R, C, size, size) tensor. features (B, C, H, W), best channels-last; rois (R, 5) float32: batch index, x1, y1,
    x2, y2 in input pixels."""
    r = rois.shape[0]
    if r == 0:
        return features.new_zeros((0, size, size, features.shape[1])).permute(0, 3, 1, 2)
    batch = rois[:, 0].long()
    parts, order = [], []
    for i in range(features.shape[0]):
        mine = (batch == i).nonzero().squeeze(1)
        if mine.numel():
            parts.append(ImageRoIPool(features[i], rois[mine, 1:], size, scale)())
            order.append(mine)
    pooled = parts[0] if len(parts) == 1 else torch.cat(parts)
    order = torch.cat(order)
    if not bool((order == torch.arange(r, device=order.device)).all()):  # not grouped by image: back to their order
        pooled = pooled[torch.argsort(order)]
    return pooled.contiguous(memory_format=torch.channels_last)
