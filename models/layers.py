"""Transformer building blocks shared by every preset (post-LayerNorm, as BERT and the seed papers)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# CPU fp32 inference runs the encoder's linear layers through oneDNN on weights packed once (see Linear).
# VLSERVE_PACK_CPU_WEIGHTS=0 turns it off (it keeps a second, packed copy of those weights in memory).
PACK_CPU_WEIGHTS = os.environ.get("VLSERVE_PACK_CPU_WEIGHTS", "1") != "0"
_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S) 1 = keep / 0 = pad  ->  (B, 1, 1, S) additive mask for attention scores."""
    mask = mask[:, None, None, :].to(dtype)
    return (1.0 - mask) * torch.finfo(dtype).min


def _weight_version(weight: torch.Tensor) -> int | None:
    try:
        return weight._version  # bumped by every in-place change (optimizer step, load_state_dict)
    except RuntimeError:  # an inference tensor: it can only change inside inference mode, where nothing packs twice
        return None


def eager() -> bool:
    """Not being traced, scripted, compiled or exported (where shapes must not depend on the data)."""
    return not (torch.jit.is_tracing() or torch.jit.is_scripting() or torch.compiler.is_compiling()
                or torch.onnx.is_in_onnx_export())


class ScaledLayerNorm(nn.LayerNorm):
    """A LayerNorm whose weight starts at `init_scale` instead of 1 (VLModel's initialisation reads it): VL-BERT's
    visual_ln_text / visual_ln_object start at 0, so a new input is added to a pretrained model's embeddings gradually."""

    def __init__(self, width: int, eps: float, init_scale: float):
        super().__init__(width, eps=eps)
        self.init_scale = init_scale


class Linear(nn.Linear):
    """nn.Linear (same parameters and keys) whose CPU inference uses a oneDNN pre-packed weight.

    Plain nn.Linear (MKL sgemm) packs the weight inside every call; with few rows (batch 1: 56 tokens) that
    is a large share of the work, and the pre-packed oneDNN GEMM ran 1.2-1.4x faster here (docs/BENCHMARKS.md).
    The packed copy is made on the first no-grad call in eval mode and re-made whenever the weight or `gemm_dtype`
    changes; it is dropped whenever the module switches mode (`train()` / `eval()`), and a module in training mode
    never packs: a fused optimizer step updates the weight in place without bumping its `_version`.
    Autograd, other devices and dtypes, tracing, compiling and ONNX export take the plain F.linear path.
    `activation="gelu"` fuses exact GELU into the GEMM.

    `gemm_dtype` (see `set_cpu_gemm_dtype`) = torch.bfloat16 runs that GEMM in bfloat16 on a bfloat16 packed
    weight, float32 out (bfloat16 with `gemm_out`, for a GEMM or attention that follows), as autocast does in
    training: LayerNorm and the residual stream stay float32. On CPUs with native bfloat16 dot products
    (AVX512-BF16, AMX) it is the fast path for large batches.
    """

    _packed: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None
    gemm_dtype: torch.dtype = torch.float32

    def _fast_path(self, x: torch.Tensor) -> bool:
        return (
            PACK_CPU_WEIGHTS and _ONEDNN_LINEAR and not torch.is_grad_enabled() and not self.training
            and x.device.type == "cpu" and x.dtype in (torch.float32, self.gemm_dtype) and x.layout == torch.strided
            and x.numel() > 0
            and self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
            and eager()
        )

    def packed_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(packed weight, bias) in `gemm_dtype`, re-made when the weight or the dtype changed."""
        bias_key = None if self.bias is None else (self.bias.data_ptr(), _weight_version(self.bias))
        key = (self.weight.data_ptr(), _weight_version(self.weight), bias_key, self.gemm_dtype)
        if self._packed is None or self._packed[0] != key:
            weight = self.weight.detach().to(self.gemm_dtype)
            bias = None if self.bias is None else self.bias.detach().to(self.gemm_dtype)
            self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(weight), bias)
        return self._packed[1], self._packed[2]

    def forward(self, x: torch.Tensor, activation: str = "none", gemm_out: bool = False) -> torch.Tensor:
        """`gemm_out`: on the fast path, return the GEMM's dtype (bfloat16 under `gemm_dtype`) instead of float32,
        for a caller that feeds it straight into another GEMM or attention (no round trip through float32)."""
        if self._fast_path(x):
            algorithm = "none" if activation == "gelu" else ""  # "none": exact (erf) GELU, as F.gelu
            weight, bias = self.packed_weight()
            y = torch.ops.mkldnn._linear_pointwise(x.to(self.gemm_dtype), weight, bias, activation, [], algorithm)
            return y if gemm_out else y.float()  # no-ops in float32
        y = F.linear(x, self.weight, self.bias)
        return F.gelu(y) if activation == "gelu" else y

    def train(self, mode: bool = True) -> "Linear":
        # fused/foreach optimizer steps leave `_version` alone: a stale packed copy must not outlive a training phase
        self._packed = None
        return super().train(mode)

    def __getstate__(self):
        return {**self.__dict__, "_packed": None}  # the packed copy is a cache: never pickled or deep-copied


# oneDNN's ISA levels (ONEDNN_MAX_CPU_ISA) at which it computes bfloat16 dot products natively; a cap below them
# (AVX512_CORE, AVX2, ...) makes it emulate bfloat16, as on a CPU without AVX512-BF16 or AMX.
_ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
                     "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL", "DEFAULT")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 dot products natively (AVX512-BF16 or AMX-BF16) and oneDNN may use them
    (`ONEDNN_MAX_CPU_ISA` unset or at a bfloat16 level); elsewhere oneDNN emulates them and a bfloat16 GEMM is
    slower than float32."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap and cap not in _ONEDNN_BF16_ISAS:
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no way to tell cheaply, so never assume it
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def bf16_unavailable(device: torch.device) -> str | None:
    """Why bfloat16 would not be fast on `device` (a GPU's autocast, the CPU's packed GEMMs), or None when it is."""
    if device.type == "cuda":
        return None if torch.cuda.is_bf16_supported() else "this GPU has no bfloat16 arithmetic"
    return cpu_bf16_unavailable()


def cpu_bf16_unavailable() -> str | None:
    """Why bfloat16 GEMMs would not be fast on the CPU inference path (`Linear`'s packed weights), or None when they are."""
    if not cpu_has_native_bf16():
        return ("this CPU has no native bfloat16 dot products (AVX512-BF16 or AMX): oneDNN would emulate them, "
                "slower than float32")
    if not (PACK_CPU_WEIGHTS and _ONEDNN_LINEAR):
        return "the CPU bfloat16 path runs on packed oneDNN weights, which VLSERVE_PACK_CPU_WEIGHTS=0 turns off"
    return None


def set_cpu_gemm_dtype(model: nn.Module, dtype: torch.dtype) -> int:
    """Run every `Linear` of `model` in `dtype` (float32 or bfloat16) on the CPU inference fast path; returns how
    many layers it set. Weights stay float32 (training, export and checkpoints are unaffected)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"CPU GEMM dtype must be float32 or bfloat16, got {dtype}")
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise ValueError("this CPU has no oneDNN bfloat16 GEMM (it needs AVX512); keep float32")
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in layers:
        layer.gemm_dtype = dtype
    return len(layers)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float, need_probs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled dot-product attention over (B, heads, S, d); returns probabilities only when asked.

    Inference runs torch's fused kernel. Training on the CPU runs the plain matmul-softmax-matmul: at these
    sequence lengths the fused kernel's forward + backward was about 4x slower (batch 32, 28 tokens, bf16
    autocast), the demo's no-dropout training step went from 268 to 196 ms (benchmarks/train_step.py), and the
    plain path trained to far better accuracy in the same steps (docs/RESULTS.md, "Recipe levers")."""
    if mask is not None and mask.dtype != q.dtype:  # bfloat16 q/k/v from a bf16 GEMM (inference)
        mask = mask.to(q.dtype)
    if not need_probs and not (torch.is_grad_enabled() and q.device.type == "cpu"):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout), None
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, h, Sq, Sk)
    if mask is not None:
        scores = scores + mask
    probs = scores.softmax(-1)
    return F.dropout(probs, dropout, training=dropout > 0) @ v, probs


class Packing:
    """The real tokens of a padded (B, S) batch, for layers that run token-wise work on them alone.

    A batch pads every sequence to its longest (a training batch of the demo's mix is about one third padding: short
    questions beside long listings, 1 to 8 regions). The projections, the feed-forward and the LayerNorms act on
    each token alone, so they run on the (N, W) real tokens (`pack`); only attention needs the padded (B, S) layout,
    where the padding is masked out of every key (`unpack` fills it with zeros). The real tokens' outputs are those
    of the padded computation: the padding never reached them (docs/BENCHMARKS.md, "Training step: real tokens only")."""

    def __init__(self, mask: torch.Tensor):  # (B, S) 1 = real
        self.batch, self.length = mask.shape
        self.index = mask.reshape(-1).nonzero().squeeze(1)  # (N,) real tokens' flat positions

    MAX_REAL_SHARE = 0.75  # above it the gathers cost more than the padding they skip (docs/BENCHMARKS.md)

    @staticmethod
    def worthwhile(mask: torch.Tensor) -> bool:
        """Pack where at most MAX_REAL_SHARE of the batch's slots are real tokens, in eager mode only (the packed
        shapes depend on the data)."""
        return eager() and mask.float().mean().item() <= Packing.MAX_REAL_SHARE

    def firsts(self) -> torch.Tensor:
        """(B,) rows of the packed tokens that are each sequence's first token (always real: [CLS])."""
        return (self.index % self.length == 0).nonzero().squeeze(1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, W) -> (N, W), the real tokens."""
        return x.reshape(self.batch * self.length, -1).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(N, W) -> (B, S, W), zeros at the padding."""
        full = x.new_zeros(self.batch * self.length, x.shape[-1])
        return full.index_copy(0, self.index, x).view(self.batch, self.length, -1)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, heads, -1).transpose(1, 2)  # (B, h, S, d)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)  # (B, S, h*d)


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused QKV projection, residual and LayerNorm."""

    def __init__(self, width: int, heads: int, dropout: float, attention_dropout: float, eps: float):
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.qkv = Linear(width, 3 * width)
        self.dense = Linear(width, width)
        self.dropout = nn.Dropout(dropout)
        self.LayerNorm = nn.LayerNorm(width, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, need_probs: bool = False, packing: Packing | None = None,
                first_only: bool = False):
        """x: (B, S, H), or with `packing` the (N, H) real tokens (the output likewise). `first_only`: the output
        (B, H) of each sequence's first token alone (every token's keys and values, one query)."""
        qkv = self.qkv(x, gemm_out=True)  # bfloat16 under a bf16 gemm_dtype
        q, k, v = (packing.unpack(qkv) if packing else qkv).chunk(3, dim=-1)  # 3 x (B, S, H)
        if first_only:
            q, x = q[:, :1], x[packing.firsts()] if packing else x[:, 0]
        p = self.attention_dropout if self.training else 0.0
        ctx, probs = attend(split_heads(q, self.heads), split_heads(k, self.heads), split_heads(v, self.heads), mask, p, need_probs)
        ctx = merge_heads(ctx)
        ctx = ctx[:, 0] if first_only else packing.pack(ctx) if packing else ctx
        return self.LayerNorm(x + self.dropout(self.dense(ctx))), probs


class CrossAttention(nn.Module):
    """Queries from one stream, keys and values from the other; residual and LayerNorm on the query stream."""

    def __init__(
        self, width: int, ctx_width: int, heads: int, dropout: float, attention_dropout: float, eps: float, inner: int = 0
    ):
        super().__init__()
        inner = inner or width  # attention width (ViLBERT's bi-attention differs from both streams)
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.query = Linear(width, inner)
        self.kv = Linear(ctx_width, 2 * inner)
        self.dense = Linear(inner, width)
        self.dropout = nn.Dropout(dropout)
        self.LayerNorm = nn.LayerNorm(width, eps=eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor | None, need_probs: bool = False):
        k, v = self.kv(ctx).chunk(2, dim=-1)  # 2 x (B, Sk, H)
        p = self.attention_dropout if self.training else 0.0
        q = split_heads(self.query(x), self.heads)
        ctx_out, probs = attend(q, split_heads(k, self.heads), split_heads(v, self.heads), ctx_mask, p, need_probs)
        return self.LayerNorm(x + self.dropout(self.dense(merge_heads(ctx_out)))), probs


class FeedForward(nn.Module):
    """Position-wise FFN (GELU) with residual and LayerNorm."""

    def __init__(self, width: int, inner: int, dropout: float, eps: float):
        super().__init__()
        self.fc1 = Linear(width, inner)
        self.fc2 = Linear(inner, width)
        self.dropout = nn.Dropout(dropout)
        self.LayerNorm = nn.LayerNorm(width, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(x + self.dropout(self.fc2(self.fc1(x, activation="gelu", gemm_out=True))))


class TransformerLayer(nn.Module):
    """BERT layer: self-attention then feed-forward."""

    def __init__(self, width: int, heads: int, inner: int, dropout: float, attention_dropout: float, eps: float):
        super().__init__()
        self.attention = SelfAttention(width, heads, dropout, attention_dropout, eps)
        self.ffn = FeedForward(width, inner, dropout, eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, need_probs: bool = False, packing: Packing | None = None,
                first_only: bool = False):
        """`first_only`: each sequence's first token alone (B, H), what a head reading only the pooled vector needs
        of the last layer (about a sixth of its work at the demo's lengths)."""
        x, probs = self.attention(x, mask, need_probs, packing, first_only)
        return self.ffn(x), probs


class FeatureNorm(nn.Module):
    """(x - mean) / std per feature dimension: the detector's raw region features span very different scales
    per dimension, and a fresh visual projection learns from them far more slowly than from standardised ones.
    The statistics are fitted once on the training regions (`fit`) and saved with the weights as buffers."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    @torch.no_grad()
    def fit(self, features, mask, eps: float = 1e-3, chunk: int = 4096) -> None:
        """features (M, N, D), mask (M, N) with 1 = real region (numpy or torch): statistics of the real regions,
        accumulated in float64 over chunks of images (a large table never becomes one float64 copy)."""
        total, sq, count = torch.zeros(self.mean.shape[0], dtype=torch.float64), 0.0, 0
        for s in range(0, len(features), chunk):
            f = torch.as_tensor(features[s : s + chunk])
            if f.shape[-1] != self.mean.shape[0]:
                raise ValueError(f"features have width {f.shape[-1]}, the encoder expects {self.mean.shape[0]}")
            rows = f[torch.as_tensor(mask[s : s + chunk]).bool()].double()  # (R, D)
            total, sq, count = total + rows.sum(0), sq + (rows * rows).sum(0), count + rows.shape[0]
        if count < 2:
            raise ValueError("feature statistics need at least 2 real regions")
        mean = total / count
        var = (sq - count * mean * mean) / (count - 1)
        self.mean.copy_(mean.float())
        self.std.copy_((var.clamp(min=0).sqrt() + eps).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)


def normalized_features(norm: FeatureNorm | None, region_features: torch.Tensor, image_feature: torch.Tensor | None):
    """Region (and whole-image) features through the encoder's FeatureNorm, when it has one."""
    if norm is None:
        return region_features, image_feature
    return norm(region_features), None if image_feature is None else norm(image_feature)


class Pooler(nn.Module):
    """act(W h_first): the [CLS] (or [IMG]) summary vector; tanh as BERT, ReLU as ViLBERT's stream poolers."""

    def __init__(self, width: int, out: int, activation: str = "tanh"):
        super().__init__()
        self.dense = Linear(width, out)
        self.activation = torch.tanh if activation == "tanh" else torch.relu

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden[:, 0]))


class TextEmbeddings(nn.Module):
    """Word + position + segment embeddings (LayerNorm and dropout are applied by the caller)."""

    def __init__(self, vocab: int, width: int, positions: int, segments: int, pad_id: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, width, padding_idx=pad_id)
        self.position_embeddings = nn.Embedding(positions, width)
        self.token_type_embeddings = nn.Embedding(segments, width)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # (1, T)
        return (
            self.word_embeddings(input_ids) + self.position_embeddings(position_ids) + self.token_type_embeddings(token_type_ids)
        )  # (B, T, H)
