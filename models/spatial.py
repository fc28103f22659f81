"""Box geometry: the spatial encodings the presets derive from detector boxes (never stored)."""
from __future__ import annotations

import math

import torch


def normalize_boxes(boxes: torch.Tensor, image_hw: torch.Tensor) -> torch.Tensor:
    """Pixel x1,y1,x2,y2 (..., 4) and image (h, w) (..., 2) -> boxes scaled to [0, 1] (LXMERT, VL-BERT 4-d)."""
    h, w = image_hw[..., 0:1].to(boxes.dtype), image_hw[..., 1:2].to(boxes.dtype)
    scale = torch.cat([w, h, w, h], dim=-1)
    if scale.dim() < boxes.dim():
        scale = scale.unsqueeze(-2)
    return (boxes / scale).clamp(0.0, 1.0)


def box_area(norm_boxes: torch.Tensor) -> torch.Tensor:
    """Area of normalized boxes (..., 4) -> (...,): the fraction of the image a box covers."""
    return (norm_boxes[..., 2] - norm_boxes[..., 0]).clamp(min=0) * (norm_boxes[..., 3] - norm_boxes[..., 1]).clamp(min=0)


def spatial_5d(norm_boxes: torch.Tensor) -> torch.Tensor:
    """ViLBERT's 5-d location: normalized x1, y1, x2, y2 and the covered area fraction."""
    return torch.cat([norm_boxes, box_area(norm_boxes).unsqueeze(-1)], dim=-1)


def sinusoidal_box_embedding(norm_boxes: torch.Tensor, dim: int, wave_length: float = 1000.0) -> torch.Tensor:
    """VL-BERT geometry embedding: sin/cos of each scaled coordinate at dim/8 frequencies -> (..., dim)."""
    if dim % 8:
        raise ValueError(f"geometry dim {dim} must be a multiple of 8 (4 coordinates x sin/cos)")
    freqs = dim // 8
    exponents = torch.arange(freqs, device=norm_boxes.device, dtype=norm_boxes.dtype) / freqs
    inv = wave_length ** (-exponents)  # (F,)
    angles = (norm_boxes * 100.0).unsqueeze(-1) * inv  # (..., 4, F)
    emb = torch.cat([angles.sin(), angles.cos()], dim=-1)  # (..., 4, 2F)
    return emb.flatten(-2)  # (..., dim)


def center_size_box_embedding(norm_boxes: torch.Tensor, dim: int, wave_length: float = 1000.0) -> torch.Tensor:
    """jackroos/VL-BERT's box geometry (its coordinate_embeddings): centre x, centre y, width and height, each scaled
    to [0, 100] and divided by wave_length ** (i / F) at F = dim / 8 frequencies; per coordinate F sines then F
    cosines -> (..., dim). Computed as it does (a division, not a multiplication by the inverse), so the rounding is
    the same."""
    if dim % 8:
        raise ValueError(f"geometry dim {dim} must be a multiple of 8 (4 coordinates x sin/cos)")
    freqs = dim // 8
    centre = (norm_boxes[..., :2] + norm_boxes[..., 2:]) / 2
    size = norm_boxes[..., 2:] - norm_boxes[..., :2]
    pos = torch.cat([centre, size], dim=-1) * 100  # (..., 4)
    dim_mat = wave_length ** (torch.arange(freqs, dtype=norm_boxes.dtype, device=norm_boxes.device) / freqs)
    angles = pos.unsqueeze(-1) / dim_mat  # (..., 4, F)
    return torch.cat([angles.sin(), angles.cos()], dim=-1).flatten(-2)  # (..., dim)


def pairwise_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU between boxes a (M, 4) and b (K, 4) in x1,y1,x2,y2 -> (M, K)."""
    area_a = box_area(a)[:, None]
    area_b = box_area(b)[None, :]
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area_a + area_b - inter
    return torch.where(union > 0, inter / union.clamp(min=math.ulp(1.0)), torch.zeros_like(inter))
