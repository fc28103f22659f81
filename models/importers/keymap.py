"""Key maps from BERT-style (transformers) state dicts to ours: our key -> source keys, concatenated on dim 0."""
from __future__ import annotations

import torch

KeyMap = dict[str, list[str]]


def linear(dst: str, src: str) -> KeyMap:
    return {f"{dst}.weight": [f"{src}.weight"], f"{dst}.bias": [f"{src}.bias"]}


def fused(dst: str, srcs: list[str]) -> KeyMap:
    """One fused projection (our qkv / kv) from separate transformers projections."""
    return {f"{dst}.weight": [f"{s}.weight" for s in srcs], f"{dst}.bias": [f"{s}.bias" for s in srcs]}


def self_attention(dst: str, src_self: str, src_out: str) -> KeyMap:
    """Our SelfAttention from transformers' {query,key,value} + output {dense, LayerNorm}."""
    return {
        **fused(f"{dst}.qkv", [f"{src_self}.query", f"{src_self}.key", f"{src_self}.value"]),
        **linear(f"{dst}.dense", f"{src_out}.dense"),
        **linear(f"{dst}.LayerNorm", f"{src_out}.LayerNorm"),
    }


def cross_attention(dst: str, src_att: str, src_out: str) -> KeyMap:
    return {
        **linear(f"{dst}.query", f"{src_att}.query"),
        **fused(f"{dst}.kv", [f"{src_att}.key", f"{src_att}.value"]),
        **linear(f"{dst}.dense", f"{src_out}.dense"),
        **linear(f"{dst}.LayerNorm", f"{src_out}.LayerNorm"),
    }


def feed_forward(dst: str, src_inter: str, src_out: str) -> KeyMap:
    return {
        **linear(f"{dst}.fc1", f"{src_inter}.dense"),
        **linear(f"{dst}.fc2", f"{src_out}.dense"),
        **linear(f"{dst}.LayerNorm", f"{src_out}.LayerNorm"),
    }


def bert_layer(dst: str, src: str) -> KeyMap:
    """Our TransformerLayer from a transformers BertLayer at prefix `src`."""
    return {
        **self_attention(f"{dst}.attention", f"{src}.attention.self", f"{src}.attention.output"),
        **feed_forward(f"{dst}.ffn", f"{src}.intermediate", f"{src}.output"),
    }


def bert_embeddings(dst: str, src: str) -> KeyMap:
    names = ("word_embeddings", "position_embeddings", "token_type_embeddings")
    out: KeyMap = {f"{dst}.{n}.weight": [f"{src}.{n}.weight"] for n in names}
    return {**out, **linear(f"{dst}.LayerNorm", f"{src}.LayerNorm")}


def apply_keymap(keymap: KeyMap, source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Build our tensors from the source state; raises KeyError naming the first absent source key, ValueError
    naming a 0-d tensor (our weights are vectors and matrices) or one that cannot be fused with the first of its
    group."""
    out = {}
    for dst, srcs in keymap.items():
        absent = [s for s in srcs if s not in source]
        if absent:
            raise KeyError(f"source checkpoint lacks {absent[0]} (needed for {dst})")
        tensors = [source[s] for s in srcs]
        for s, t in zip(srcs, tensors):
            if t.dim() == 0:
                raise ValueError(f"tensor {s} has shape (), expected a 1-d or 2-d tensor (for {dst})")
        for s, t in zip(srcs[1:], tensors[1:]):
            if t.dim() != tensors[0].dim() or t.shape[1:] != tensors[0].shape[1:]:
                raise ValueError(f"tensor {s} has shape {tuple(t.shape)}, which cannot be fused with {srcs[0]} "
                                 f"{tuple(tensors[0].shape)} into {dst}")
        out[dst] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
    return out
