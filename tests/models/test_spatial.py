"""Box geometry against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from models.spatial import box_area, normalize_boxes, pairwise_iou, sinusoidal_box_embedding, spatial_5d


def close(got: torch.Tensor, expected) -> None:
    torch.testing.assert_close(got, torch.as_tensor(expected, dtype=got.dtype), atol=1e-6, rtol=0)


def test_normalize_boxes_divides_by_width_and_height_and_clamps():
    boxes = torch.tensor([[10.0, 20.0, 110.0, 70.0], [-5.0, 0.0, 250.0, 120.0]])  # pixels, x1 y1 x2 y2
    hw = torch.tensor([100, 200])  # height 100, width 200
    close(normalize_boxes(boxes, hw), [[0.05, 0.2, 0.55, 0.7], [0.0, 0.0, 1.0, 1.0]])


def test_normalize_boxes_batched_per_image_size():
    boxes = torch.tensor([[[50.0, 50.0, 100.0, 100.0]], [[50.0, 50.0, 100.0, 100.0]]])  # (B=2, N=1, 4)
    hw = torch.tensor([[100, 100], [200, 400]])  # (B, 2)
    close(normalize_boxes(boxes, hw), [[[0.5, 0.5, 1.0, 1.0]], [[0.125, 0.25, 0.25, 0.5]]])


def test_box_area_and_spatial_5d():
    boxes = torch.tensor([[0.1, 0.2, 0.5, 0.7], [0.0, 0.0, 1.0, 1.0], [0.6, 0.6, 0.4, 0.9]])
    close(box_area(boxes), [0.4 * 0.5, 1.0, 0.0])  # an inverted box covers nothing
    close(spatial_5d(boxes[:1]), [[0.1, 0.2, 0.5, 0.7, 0.2]])
    assert spatial_5d(torch.rand(2, 3, 4)).shape == (2, 3, 5)


def test_sinusoidal_box_embedding_at_a_known_point():
    # dim 16 -> 2 frequencies per coordinate: 1000^0 = 1 and 1000^-1/2; coordinates are scaled by 100 first
    box = torch.tensor([0.5, 0.0, 1.0, 0.25], dtype=torch.float64)
    inv = [1.0, 1000 ** -0.5]
    expected = []
    for coordinate in (50.0, 0.0, 100.0, 25.0):  # per coordinate: sin at each frequency, then cos
        expected += [math.sin(coordinate * f) for f in inv] + [math.cos(coordinate * f) for f in inv]
    close(sinusoidal_box_embedding(box, 16), expected)
    assert sinusoidal_box_embedding(torch.rand(2, 5, 4), 256).shape == (2, 5, 256)


def test_sinusoidal_box_embedding_needs_a_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        sinusoidal_box_embedding(torch.rand(3, 4), 12)


def test_pairwise_iou():
    a = torch.tensor([[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 1.0, 1.0]])
    b = torch.tensor([
        [1.0, 1.0, 3.0, 3.0],  # overlaps a[0] in a 1x1 square: 1 / (4 + 4 - 1)
        [0.0, 0.0, 2.0, 2.0],  # identical to a[0]; contains a[1]: 1 / 4
        [5.0, 5.0, 6.0, 6.0],  # disjoint from both
        [1.0, 0.0, 2.0, 1.0],  # shares only an edge with a[1]
    ])
    close(pairwise_iou(a, b), [[1 / 7, 1.0, 0.0, 0.25], [0.0, 0.25, 0.0, 0.0]])


def test_pairwise_iou_of_empty_boxes_is_zero_not_nan():
    point = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    iou = pairwise_iou(point, point)
    assert iou.item() == 0.0
