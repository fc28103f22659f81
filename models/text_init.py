"""Initialise the text side of any preset at hidden size 384 from the pretrained MiniLM-L6 BERT, offline."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from .importers.keymap import apply_keymap, bert_embeddings, bert_layer, linear
from .tokenizer import minilm_dir
from .vl_model import VLModel


def minilm_state(path: str | Path | None = None) -> dict[str, torch.Tensor]:
    path = Path(path) if path else minilm_dir() / "model.safetensors"
    return load_file(str(path))


@torch.no_grad()
def init_text_from_minilm(model: VLModel, path: str | Path | None = None) -> list[str]:
    """Copy embeddings, the first text layers and the pooler from MiniLM; returns the keys it set.

    Single-stream presets get MiniLM's layers as their fused layers; two-stream presets as their text layers.
    Extra segment rows (VL-BERT's image segment C) start from segment A's row.
    """
    src = minilm_state(path)
    enc = model.config.encoder
    width = src["embeddings.word_embeddings.weight"].shape[1]
    if enc.hidden_size != width:
        raise ValueError(f"MiniLM has hidden size {width}; this model's text side has {enc.hidden_size}")
    layers = sum(k.endswith(".attention.self.query.weight") for k in src)
    keymap = bert_embeddings("encoder.embeddings", "embeddings")
    for i in range(min(layers, enc.num_layers)):
        keymap |= bert_layer(f"encoder.layer.{i}", f"encoder.layer.{i}")
    if enc.preset != "vilbert" and enc.pooler:  # ViLBERT's pooler maps to the co-attention width, not H
        keymap |= linear("encoder.pooler.dense", "pooler.dense")
    new = apply_keymap(keymap, src)
    own = model.state_dict()
    segments = "encoder.embeddings.token_type_embeddings.weight"
    if own[segments].shape[0] > new[segments].shape[0]:
        rows = new[segments]
        extra = rows[:1].expand(own[segments].shape[0] - rows.shape[0], -1)
        new[segments] = torch.cat([rows, extra], dim=0)
    if enc.preset in ("visualbert", "u-visualbert") and enc.embedding_style == "vlserve":
        # VisualBERT's visual segment/position tables start as copies of the text ones (special_visual_initialize);
        # u-visualbert's published embeddings give regions and tags neither
        new["encoder.embeddings.visual_token_type_embeddings.weight"] = new[segments].clone()
        new["encoder.embeddings.visual_position_embeddings.weight"] = new["encoder.embeddings.position_embeddings.weight"].clone()
    for key, value in new.items():
        if tuple(own[key].shape) != tuple(value.shape):
            raise ValueError(f"{key}: MiniLM tensor {tuple(value.shape)} does not fit {tuple(own[key].shape)}")
        own[key].copy_(value)
    return sorted(new)
