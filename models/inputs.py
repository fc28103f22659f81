"""The padded batch every encoder and head reads."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class VLInputs:
    input_ids: torch.Tensor  # (B, T) WordPiece ids; (B, C, T) for multiple choice
    attention_mask: torch.Tensor  # (B, T) 1 = real token
    token_type_ids: torch.Tensor  # (B, T) segment ids
    region_features: torch.Tensor  # (B, N, D); (B, 2, N, D) for NLVR2 image pairs
    region_boxes: torch.Tensor  # (B, N, 4) normalized x1, y1, x2, y2 in [0, 1]
    region_mask: torch.Tensor  # (B, N) 1 = real region (num_boxes), 0 = padding
    image_feature: torch.Tensor | None = None  # (B, D) whole-image feature (VL-BERT, ViLBERT [IMG])
    tag_ids: torch.Tensor | None = None  # (B, N) word ids of detector tags, -1 = none (U-VisualBERT)
    phrase_index: torch.Tensor | None = None  # (B, P) token index of each phrase's last sub-word, -1 = none

    def encoder_kwargs(self) -> dict[str, torch.Tensor | None]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "phrase_index"
        }

    def replace(self, **changes) -> VLInputs:
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> VLInputs:
        return VLInputs(**{
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(self)
        })
