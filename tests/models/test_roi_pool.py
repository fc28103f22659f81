"""The serving form's RoIPool (models/detector/roi_pool.py) equals torchvision's roi_pool bit for bit."""
from __future__ import annotations

import pytest
import torch
from torchvision.ops import roi_pool

from models.detector.roi_pool import ImageRoIPool, roi_pool_channels_last

STRIDE = 16


def boxes(n: int, h: int, w: int, batch: int, g: torch.Generator) -> torch.Tensor:
    """Random boxes over and past a (h, w) map's image, plus the awkward ones: a point, the whole image, an inverted
    box, boxes wholly outside, half-pixel corners (C's round() and torch.round disagree on halves)."""
    W, H = w * STRIDE, h * STRIDE
    x1 = torch.rand(n, generator=g) * W * 1.2 - 30
    y1 = torch.rand(n, generator=g) * H * 1.2 - 30
    x2 = x1 + torch.rand(n, generator=g) * W
    y2 = y1 + torch.rand(n, generator=g) * H
    rois = torch.stack([torch.randint(0, batch, (n,), generator=g).float(), x1, y1, x2, y2], 1)
    special = torch.tensor([[8.0, 8.0, 8.0, 8.0], [0, 0, W, H], [40.0, 56.0, 24.0, 40.0], [-60, -60, -20, -20],
                            [W + 8, 0, W + 70, 30], [7.5 * 16, 8.5 * 16, 39.5 * 16, 55.5 * 16], [8.0, 24.0, 40.0, 56.0]])
    rois[: len(special), 1:] = special
    return rois


@pytest.mark.parametrize("h,w,batch,size", [(7, 9, 1, 14), (38, 50, 2, 14), (63, 38, 3, 7), (5, 6, 1, 2), (38, 50, 1, 2)])
def test_equals_torchvision(h, w, batch, size):
    g = torch.Generator().manual_seed(h * 100 + w)
    x = torch.randn(batch, 8, h, w, generator=g)
    rois = boxes(120, h, w, batch, g)
    want = roi_pool(x, rois, size, 1 / STRIDE)
    got = roi_pool_channels_last(x.contiguous(memory_format=torch.channels_last), rois, size, 1 / STRIDE)
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got, want)
    # maxima are exact in any dtype: pooling bfloat16 values is rounding the float32 pool
    assert torch.equal(roi_pool_channels_last(x.bfloat16(), rois, size, 1 / STRIDE), want.bfloat16())


def test_no_regions():
    out = roi_pool_channels_last(torch.randn(1, 4, 5, 5), torch.zeros(0, 5), 3, 1 / STRIDE)
    assert out.shape == (0, 4, 3, 3)


def test_image_pool_subsets_by_visits_and_by_tables():
    """ImageRoIPool pools any subset of an image's boxes as torchvision does: a few boxes from their cells while the
    tables are not built (the awkward boxes among them: a point, boxes outside the image, an inverted one, whose
    bins are empty), then from the tables once a larger subset built them."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 8, 38, 50, generator=g)
    rois = boxes(200, 38, 50, 1, g)
    pool = ImageRoIPool(x.contiguous(memory_format=torch.channels_last)[0], rois[:, 1:], 14, 1 / STRIDE)
    want = roi_pool(x, rois, 14, 1 / STRIDE)
    few = torch.tensor([3, 17, 5, 0, 2, 4, 6, 150])
    assert int(pool.cells[few].sum()) < pool.table_cells
    got = pool(few)
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got, want[few]) and pool.table is None  # from the cells
    assert torch.equal(pool(few[:1]), want[few[:1]]) and torch.equal(pool(few[:0]), want[few[:0]])
    assert torch.equal(pool(), want) and pool.table is not None  # all of them: the tables
    assert torch.equal(pool(few), want[few])  # from the tables now
