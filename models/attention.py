"""Where text looks in the image: the attention of text tokens over regions, read off an encoder pass.

Single-stream presets are read at every layer (the text rows and region columns of the self-attention, whose sequence
is laid out [text][regions](...)); two-stream presets at their cross-modality layers (text queries, region keys).
The grounding analysis (training/grounding.py) ranks heads by it, and the service's `explain=true` answers it.
"""
from __future__ import annotations

import torch

from .inputs import VLInputs
from .outputs import EncoderOutput
from .vl_model import VLModel


def layer_kind(model: VLModel) -> str:
    """What one layer of the attention stack is: every layer, or the cross-modality layers of a two-stream model."""
    return "cross-modality layer" if model.config.encoder.is_two_stream else "layer"


def attention_of(model: VLModel, enc: EncoderOutput, text_len: int, num_regions: int) -> torch.Tensor:
    """(L, B, heads, T, N) attention of the text tokens over the regions, from an output_attentions pass whose text
    is `text_len` tokens long (padded) and whose region slots are `num_regions`."""
    if model.config.encoder.is_two_stream:
        return torch.stack(enc.cross_attentions)  # text queries, region keys (ViLBERT's [IMG] column left out)
    return torch.stack([a[:, :, :text_len, text_len : text_len + num_regions] for a in enc.attentions])


def text_region_attention(model: VLModel, inputs: VLInputs) -> torch.Tensor:
    """Attention of every text token to every region at each layer where text meets regions: (L, B, heads, T, N)."""
    enc = model.forward_features(inputs, output_attentions=True)
    return attention_of(model, enc, inputs.input_ids.shape[1], inputs.region_features.shape[1])


def explained_forward(model: VLModel, inputs: VLInputs, task: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One pass of `task` that also keeps its attention: (logits, per image of each example (L, heads, T, N)).

    A row of `inputs` holds one image, or two for NLVR2 (regions (B, 2, N, ...)); every image's attention is listed,
    example by example, as the head's prepared batch (one pass per image, or both images in one sequence) saw it.
    """
    out = model(inputs, task, output_attentions=True)  # the task's own forward: its answer is the one served
    prepared = model.heads[task].prepare(inputs)  # the shapes the encoder saw
    attention = attention_of(model, out.encoder, prepared.input_ids.shape[1], prepared.region_features.shape[1])
    n = inputs.region_features.shape[-2]  # region slots of one image
    per_image = []
    for b in range(attention.shape[1]):
        row = attention[:, b]  # (L, heads, T, N'), N' = n, or k * n with k images in one sequence
        per_image.extend(row[..., s : s + n] for s in range(0, row.shape[-1], n))
    return out.logits, per_image
