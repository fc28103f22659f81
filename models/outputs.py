"""Small output dataclasses returned by encoders and models (no tuples)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class EncoderOutput:
    text: torch.Tensor | None  # (B, T, H) contextual text tokens (None from a pooled_only pass)
    image: torch.Tensor | None  # (B, N, Hv) contextual regions, one per input region (None from a pooled_only pass)
    pooled: torch.Tensor  # (B, P) fused summary the classification heads read
    sequence: torch.Tensor | None = None  # (B, S, H) whole single-stream sequence (single-stream only)
    sequence_mask: torch.Tensor | None = None  # (B, S) 1 = real element of `sequence`
    attentions: tuple[torch.Tensor, ...] | None = None  # per layer (B, heads, S, S): self-attention (text stream for two-stream)
    cross_attentions: tuple[torch.Tensor, ...] | None = None  # per cross layer (B, heads, T, N): text attending to regions
    tags: torch.Tensor | None = None  # (B, N * K, H) contextual tag tokens (u-visualbert's published embeddings), else None


@dataclass
class ModelOutput:
    logits: torch.Tensor  # task-specific, see each head
    loss: torch.Tensor | None = None  # set only when targets are given
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # secondary logits (e.g. mrc attributes)
    encoder: EncoderOutput | None = None
