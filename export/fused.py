"""Export-time attention as onnxruntime's fused operators (com.microsoft Attention / MultiHeadAttention).

onnxruntime's transformer optimizer fuses attention only in the shape transformers' BERT exports (separate
Q, K, V projections); ours has one QKV projection and cross-attention between streams, so its attention pass
finds nothing. Instead, while `fused_attention(model)` is active, every SelfAttention exports as one
`Attention` node (packed QKV GEMM + attention, the key mask as int32) and every CrossAttention as one
`MultiHeadAttention` node. In torch the same functions compute exactly what the modules do.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import CrossAttention, SelfAttention, additive_mask, merge_heads, split_heads


def key_mask(bias: torch.Tensor) -> torch.Tensor:
    """The (B, 1, 1, S) additive mask back to a (B, S) int32 keep-mask (1 = attend), as onnxruntime takes it."""
    return (bias[:, 0, 0, :] == 0).to(torch.int32)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, heads: int) -> torch.Tensor:
    mask = additive_mask(keep, q.dtype)
    ctx = F.scaled_dot_product_attention(split_heads(q, heads), split_heads(k, heads), split_heads(v, heads), attn_mask=mask)
    return merge_heads(ctx)  # (B, S, H)


class FusedSelfAttention(torch.autograd.Function):
    """x (B, S, H), packed QKV weight (3H, H) and bias (3H,), keep (B, S) -> context (B, S, H)."""

    @staticmethod
    def forward(ctx, x, weight, bias, keep, heads: int):
        q, k, v = F.linear(x, weight, bias).chunk(3, dim=-1)
        return _attend(q, k, v, keep, heads)

    @staticmethod
    def symbolic(g, x, weight, bias, keep, heads: int):
        packed = g.op("Transpose", weight, perm_i=[1, 0])  # (H, 3H): columns Q | K | V, as Attention reads them
        out = g.op("com.microsoft::Attention", x, packed, bias, keep, num_heads_i=heads)
        out.setType(x.type())
        return out


class FusedCrossAttention(torch.autograd.Function):
    """Projected q (B, S, D), k and v (B, L, D), keep (B, L) -> context (B, S, D).

    `zero_bias` (3D,) fills MultiHeadAttention's bias slot (the projections already added theirs): the
    TorchScript exporter has no way to leave an optional input out before a given one.
    """

    @staticmethod
    def forward(ctx, q, k, v, zero_bias, keep, heads: int):
        return _attend(q, k, v, keep, heads)

    @staticmethod
    def symbolic(g, q, k, v, zero_bias, keep, heads: int):
        out = g.op("com.microsoft::MultiHeadAttention", q, k, v, zero_bias, keep, num_heads_i=heads)
        out.setType(q.type())
        return out


def _self_forward(module: SelfAttention):
    def forward(x, mask, need_probs=False, packing=None, first_only=False):
        # an eager call on a packed batch or for the first token (export itself does neither): the whole pass, then
        # the rows asked for
        x = packing.unpack(x) if packing else x
        ctx = FusedSelfAttention.apply(x, module.qkv.weight, module.qkv.bias, key_mask(mask), module.heads)
        out = module.LayerNorm(x + module.dropout(module.dense(ctx)))
        return (out[:, 0] if first_only else packing.pack(out) if packing else out), None
    return forward


def _cross_forward(module: CrossAttention):
    def forward(x, ctx, ctx_mask, need_probs=False):
        k, v = module.kv(ctx).chunk(2, dim=-1)
        zero_bias = torch.zeros(3 * k.shape[-1], dtype=k.dtype, device=k.device)
        out = FusedCrossAttention.apply(module.query(x), k, v, zero_bias, key_mask(ctx_mask), module.heads)
        return module.LayerNorm(x + module.dropout(module.dense(out))), None
    return forward


@contextmanager
def fused_attention(model: nn.Module) -> Iterator[int]:
    """Within the block, the model's attention modules run (and export) as the fused functions; yields their count."""
    patched = []
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.forward = _self_forward(module)
        elif isinstance(module, CrossAttention):
            module.forward = _cross_forward(module)
        else:
            continue
        patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward  # back to the class's forward
