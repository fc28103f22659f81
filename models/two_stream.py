"""Two-stream encoders: LXMERT (language / object-relationship / cross-modality) and ViLBERT (co-attention).

Each encoder is split where the streams first meet: `encode_text` runs the text-only layers, `encode_image`
the image-only ones, and `fuse` the rest; `forward` is `fuse(encode_text(...), encode_image(...))`. Retrieval
caches each side's `StreamStates` (one text against many images, one image against many texts) and runs
only `fuse` per pair, as ViLBERT does for retrieval.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import EncoderConfig
from .layers import CrossAttention, FeatureNorm, FeedForward, Pooler, SelfAttention, TextEmbeddings, TransformerLayer, additive_mask, normalized_features
from .outputs import EncoderOutput
from .single_stream import whole_image_feature, with_whole_image
from .spatial import spatial_5d


@dataclass
class StreamStates:
    """One stream's hidden states before the streams meet; depends on that modality alone (cacheable)."""

    hidden: torch.Tensor  # (B, S, W): text (B, T, H); regions (B, N, Hv), ViLBERT's [IMG] first (B, 1+N, Hv)
    mask: torch.Tensor  # (B, S) 1 = real token / region
    attentions: tuple[torch.Tensor, ...] | None = None  # text only: self-attention of the layers run, when asked

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors kept (what a cache of states is bounded by)."""
        tensors = [self.hidden, self.mask, *(self.attentions or ())]
        return sum(t.nelement() * t.element_size() for t in tensors)

    def row(self, i: int, length: int | None = None) -> StreamStates:
        """Row i alone, its first `length` positions (all by default), copied so the batch can be freed; no attentions."""
        stop = self.hidden.shape[1] if length is None else length
        return StreamStates(self.hidden[i : i + 1, :stop].clone(), self.mask[i : i + 1, :stop].clone())  # (1, S', W)

    @staticmethod
    def cat(rows: Sequence[StreamStates]) -> StreamStates:
        """Rows padded to the longest S (zero states, mask 0) and concatenated on the batch axis; no attentions."""
        if not rows:
            raise ValueError("no stream states to concatenate")
        s = max(r.hidden.shape[1] for r in rows)
        hidden = torch.cat([F.pad(r.hidden, (0, 0, 0, s - r.hidden.shape[1])) for r in rows])  # (B, S, W)
        mask = torch.cat([F.pad(r.mask, (0, s - r.mask.shape[1])) for r in rows])  # (B, S)
        return StreamStates(hidden, mask)


class BertTextEmbeddings(TextEmbeddings):
    """Text embeddings with LayerNorm and dropout (the text side of both two-stream presets)."""

    def __init__(self, config: EncoderConfig):
        super().__init__(config.vocab_size, config.hidden_size, config.max_position_embeddings, config.type_vocab_size, config.pad_token_id)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids, token_type_ids):
        return self.dropout(self.LayerNorm(super().forward(input_ids, token_type_ids)))  # (B, T, H)


class LxmertObjectEmbeddings(nn.Module):
    """LXMERT object input: (LN(FC(feature)) + LN(FC(4-d box))) / 2 (VOLTA's controlled LXMERT: the 5-d location)."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.visn_fc = nn.Linear(config.visual_feat_dim, h)
        self.visn_layer_norm = nn.LayerNorm(h, eps=eps)
        self.box_fc = nn.Linear(config.box_dims, h)
        self.box_layer_norm = nn.LayerNorm(h, eps=eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, features: torch.Tensor, norm_boxes: torch.Tensor) -> torch.Tensor:
        x = self.visn_layer_norm(self.visn_fc(features))
        boxes = spatial_5d(norm_boxes) if self.box_fc.in_features == 5 else norm_boxes
        y = self.box_layer_norm(self.box_fc(boxes))
        return self.dropout((x + y) / 2)  # (B, N, H)


class LxmertCrossLayer(nn.Module):
    """Cross-modality layer: bi-directional cross-attention (one shared module), then self-attention, then FFN."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        c = config
        args = (c.dropout, c.attention_dropout, c.layer_norm_eps)
        self.visual_attention = CrossAttention(c.hidden_size, c.hidden_size, c.num_heads, *args)
        self.lang_self_att = SelfAttention(c.hidden_size, c.num_heads, *args)
        self.visn_self_att = SelfAttention(c.hidden_size, c.num_heads, *args)
        self.lang_ffn = FeedForward(c.hidden_size, c.intermediate_size, c.dropout, c.layer_norm_eps)
        self.visn_ffn = FeedForward(c.hidden_size, c.intermediate_size, c.dropout, c.layer_norm_eps)

    def forward(self, lang, lang_bias, visn, visn_bias, need_probs=False):
        lang_x, probs = self.visual_attention(lang, visn, visn_bias, need_probs)  # text attends to regions
        visn_x, _ = self.visual_attention(visn, lang, lang_bias)  # regions attend to text, same weights
        lang_x, _ = self.lang_self_att(lang_x, lang_bias)
        visn_x, _ = self.visn_self_att(visn_x, visn_bias)
        return self.lang_ffn(lang_x), self.visn_ffn(visn_x), probs


class LxmertEncoder(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = c = config
        args = (c.hidden_size, c.num_heads, c.intermediate_size, c.dropout, c.attention_dropout, c.layer_norm_eps)
        self.embeddings = BertTextEmbeddings(c)
        self.visn_fc = LxmertObjectEmbeddings(c)
        self.layer = nn.ModuleList(TransformerLayer(*args) for _ in range(c.num_layers))  # NL language layers
        self.r_layers = nn.ModuleList(TransformerLayer(*args) for _ in range(c.num_image_layers))  # NR object layers
        self.x_layers = nn.ModuleList(LxmertCrossLayer(c) for _ in range(c.num_cross_layers))  # NX cross layers
        if c.pooler_style == "tanh":
            self.pooler = Pooler(c.hidden_size, c.hidden_size)
        else:  # VOLTA's: ReLU poolers of their own width, the text's alone or times the whole image's
            self.t_pooler = Pooler(c.hidden_size, c.pooled_size, activation="relu")
            if c.pooler_style == "relu_mul":
                self.v_pooler = Pooler(c.hidden_size, c.pooled_size, activation="relu")
        self.feature_norm = FeatureNorm(c.visual_feat_dim) if c.feature_norm else None

    def pool(self, lang: torch.Tensor, visn: torch.Tensor) -> torch.Tensor:
        pooler = self.config.pooler_style
        if pooler == "tanh":
            return self.pooler(lang)
        return self.t_pooler(lang) * self.v_pooler(visn) if pooler == "relu_mul" else self.t_pooler(lang)

    def encode_text(self, input_ids, attention_mask, token_type_ids, output_attentions: bool = False) -> StreamStates:
        """Embeddings and the NL language layers."""
        lang = self.embeddings(input_ids, token_type_ids)  # (B, T, H)
        lang_bias = additive_mask(attention_mask, lang.dtype)
        attentions = []
        for layer in self.layer:
            lang, probs = layer(lang, lang_bias, output_attentions)
            attentions.append(probs)
        return StreamStates(lang, attention_mask, tuple(attentions) if output_attentions else None)

    def encode_image(self, region_features, region_boxes, region_mask, image_feature=None) -> StreamStates:
        """Object embeddings and the NR object-relationship layers (LXMERT has no whole-image input; VOLTA's
        controlled LXMERT puts the whole image first, mask (B, 1+N))."""
        region_features, image_feature = normalized_features(self.feature_norm, region_features, image_feature)
        if self.config.whole_image_region:  # the mean of the regions', as VOLTA's feature readers make it
            region_features, region_boxes, region_mask = with_whole_image(region_features, region_boxes, region_mask)
        visn = self.visn_fc(region_features, region_boxes)  # (B, N, H)
        visn_bias = additive_mask(region_mask, visn.dtype)
        for layer in self.r_layers:
            visn, _ = layer(visn, visn_bias)
        return StreamStates(visn, region_mask)

    def fuse(self, text: StreamStates, image: StreamStates, output_attentions: bool = False) -> EncoderOutput:
        """The NX cross-modality layers and the pooler over one text and one image per row."""
        lang, visn = text.hidden, image.hidden
        lang_bias = additive_mask(text.mask, lang.dtype)
        visn_bias = additive_mask(image.mask, visn.dtype)
        cross = []
        for layer in self.x_layers:
            lang, visn, probs = layer(lang, lang_bias, visn, visn_bias, output_attentions)
            cross.append(probs)
        first = 1 if self.config.whole_image_region else 0  # the whole image is no region of the detector's
        return EncoderOutput(
            text=lang,
            image=visn[:, first:],
            pooled=self.pool(lang, visn),
            attentions=text.attentions if output_attentions else None,
            cross_attentions=tuple(p[..., first:] for p in cross) if output_attentions else None,
        )

    def forward(self, input_ids, attention_mask, token_type_ids, region_features, region_boxes, region_mask,
                image_feature=None, tag_ids=None, output_attentions: bool = False) -> EncoderOutput:
        text = self.encode_text(input_ids, attention_mask, token_type_ids, output_attentions)
        image = self.encode_image(region_features, region_boxes, region_mask, image_feature)
        return self.fuse(text, image, output_attentions)


class VilbertImageEmbeddings(nn.Module):
    """ViLBERT image input: FC(region feature) + FC(5-d location), LayerNorm, dropout."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        w = config.image_width
        self.image_embeddings = nn.Linear(config.visual_feat_dim, w)
        self.image_location_embeddings = nn.Linear(5, w)
        self.LayerNorm = nn.LayerNorm(w, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, features: torch.Tensor, norm_boxes: torch.Tensor) -> torch.Tensor:
        x = self.image_embeddings(features) + self.image_location_embeddings(spatial_5d(norm_boxes))
        return self.dropout(self.LayerNorm(x))  # (B, N, Hv)


class CoAttentionLayer(nn.Module):
    """ViLBERT co-TRM: each stream's queries attend to the other stream's keys/values, then each stream's FFN."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        c = config
        args = (c.dropout, c.attention_dropout, c.layer_norm_eps)
        inner, heads = c.coattention_width, c.coattention_num_heads or c.image_heads
        self.text_attention = CrossAttention(c.hidden_size, c.image_width, heads, *args, inner=inner)
        self.image_attention = CrossAttention(c.image_width, c.hidden_size, heads, *args, inner=inner)
        self.text_ffn = FeedForward(c.hidden_size, c.intermediate_size, c.dropout, c.layer_norm_eps)
        self.image_ffn = FeedForward(c.image_width, c.image_ffn, c.dropout, c.layer_norm_eps)

    def forward(self, text, text_bias, image, image_bias, need_probs=False):
        text_x, probs = self.text_attention(text, image, image_bias, need_probs)
        image_x, _ = self.image_attention(image, text, text_bias)
        return self.text_ffn(text_x), self.image_ffn(image_x), probs


def without_task_token(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x without position 1 of `dim` (where ViLBERT's task token follows [CLS])."""
    return torch.cat([x.narrow(dim, 0, 1), x.narrow(dim, 2, x.shape[dim] - 2)], dim=dim)


class VilbertEncoder(nn.Module):
    """Text layers and image layers interleaved with co-attention layers; an [IMG] region (whole image) leads."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = c = config
        self.embeddings = BertTextEmbeddings(c)
        self.v_embeddings = VilbertImageEmbeddings(c)
        self.layer = nn.ModuleList(
            TransformerLayer(c.hidden_size, c.num_heads, c.intermediate_size, c.dropout, c.attention_dropout, c.layer_norm_eps)
            for _ in range(c.num_layers)
        )
        self.v_layer = nn.ModuleList(
            TransformerLayer(c.image_width, c.image_heads, c.image_ffn, c.dropout, c.attention_dropout, c.layer_norm_eps)
            for _ in range(c.num_image_layers)
        )
        self.c_layer = nn.ModuleList(CoAttentionLayer(c) for _ in range(c.num_cross_layers))
        self.t_pooler = Pooler(c.hidden_size, c.pooled_size, activation="relu")
        self.v_pooler = Pooler(c.image_width, c.pooled_size, activation="relu")
        self.feature_norm = FeatureNorm(c.visual_feat_dim) if c.feature_norm else None
        # 12-in-1's task token: a learned embedding after [CLS], its own row of the task table (no position, no segment)
        self.task_embeddings = nn.Embedding(c.task_tokens, c.hidden_size) if c.task_tokens else None

    @property
    def image_layer_ids(self) -> tuple[int, ...]:
        """Image layers run before each co-attention layer (counts from the first image layer)."""
        return self.config.coattention_image_layers or tuple(range(len(self.c_layer)))

    @property
    def text_only_layers(self) -> int:
        """Text layers that run before the first co-attention layer (all of them without co-attention)."""
        return self.config.coattention_text_layers[0] if len(self.c_layer) else len(self.layer)

    @property
    def image_only_layers(self) -> int:
        """Image layers that run before the first co-attention layer (all of them without co-attention)."""
        return self.image_layer_ids[0] if len(self.c_layer) else len(self.v_layer)

    def encode_text(self, input_ids, attention_mask, token_type_ids, output_attentions: bool = False,
                    task_token: int | None = None) -> StreamStates:
        """Embeddings and the text layers before the first co-attention layer. With a task table, `task_token`'s
        embedding follows [CLS] (states (B, 1+T, H))."""
        text = self.embeddings(input_ids, token_type_ids)  # (B, T, H)
        if self.task_embeddings is not None:
            text, attention_mask = self.with_task_token(text, attention_mask, task_token)
        text_bias = additive_mask(attention_mask, text.dtype)
        attentions = []
        for layer in self.layer[: self.text_only_layers]:
            text, probs = layer(text, text_bias, output_attentions)
            attentions.append(probs)
        return StreamStates(text, attention_mask, tuple(attentions) if output_attentions else None)

    def with_task_token(self, text: torch.Tensor, attention_mask: torch.Tensor, task_token: int | None):
        """[CLS], the task token, the other tokens (B, 1+T, H) and their mask (the task token always attended)."""
        if task_token is None or not 0 <= task_token < self.task_embeddings.num_embeddings:
            raise ValueError(f"this ViLBERT puts a task token after [CLS]: give its head a task_token in "
                             f"0..{self.task_embeddings.num_embeddings - 1} (got {task_token})")
        b = text.shape[0]
        ids = torch.full((b, 1), task_token, dtype=torch.long, device=text.device)
        token = self.embeddings.dropout(self.embeddings.LayerNorm(self.task_embeddings(ids)))  # (B, 1, H)
        text = torch.cat([text[:, :1], token.to(text.dtype), text[:, 1:]], dim=1)  # (B, 1+T, H)
        return text, torch.cat([attention_mask[:, :1], attention_mask.new_ones(b, 1), attention_mask[:, 1:]], dim=1)

    def encode_image(self, region_features, region_boxes, region_mask, image_feature=None) -> StreamStates:
        """[IMG] (the whole image) then the regions, embedded; mask (B, 1+N) with [IMG] always real. [IMG]'s feature
        is the mean of the real regions' (where the detector gives none, or with img_from_regions), its box the whole
        image (area 1)."""
        b = region_features.shape[0]
        region_features, image_feature = normalized_features(self.feature_norm, region_features, image_feature)
        if image_feature is None or self.config.img_from_regions:
            image_feature = whole_image_feature(region_features, region_mask)
        whole_box = region_boxes.new_tensor([0.0, 0.0, 1.0, 1.0]).expand(b, 1, 4)
        feats = torch.cat([image_feature.unsqueeze(1), region_features], dim=1)  # (B, 1+N, D)
        boxes = torch.cat([whole_box, region_boxes], dim=1)  # (B, 1+N, 4)
        vmask = torch.cat([region_mask.new_ones(b, 1), region_mask], dim=1)  # (B, 1+N)
        image = self.v_embeddings(feats, boxes)  # (B, 1+N, Hv)
        image_bias = additive_mask(vmask, image.dtype)
        for layer in self.v_layer[: self.image_only_layers]:
            image, _ = layer(image, image_bias)
        return StreamStates(image, vmask)

    def fuse(self, text: StreamStates, image: StreamStates, output_attentions: bool = False) -> EncoderOutput:
        """Co-attention layers with the text and image layers between and after them, then h_CLS ⊙ h_IMG."""
        text_states, image_states = text, image
        text, image = text_states.hidden, image_states.hidden
        text_bias = additive_mask(text_states.mask, text.dtype)
        image_bias = additive_mask(image_states.mask, image.dtype)
        attentions, cross = list(text_states.attentions or ()), []
        t_next, v_next = self.text_only_layers, self.image_only_layers
        for k, co_layer in enumerate(self.c_layer):
            # text and image layers up to this co-attention point
            t_end, v_end = self.config.coattention_text_layers[k], self.image_layer_ids[k]
            for layer in self.layer[t_next:t_end]:
                text, probs = layer(text, text_bias, output_attentions)
                attentions.append(probs)
            for layer in self.v_layer[v_next:v_end]:
                image, _ = layer(image, image_bias)
            t_next, v_next = t_end, v_end
            text, image, probs = co_layer(text, text_bias, image, image_bias, output_attentions)
            cross.append(probs)
        for layer in self.layer[t_next:]:
            text, probs = layer(text, text_bias, output_attentions)
            attentions.append(probs)
        for layer in self.v_layer[v_next:]:
            image, _ = layer(image, image_bias)
        pooled = self.t_pooler(text) * self.v_pooler(image)  # h_CLS ⊙ h_IMG
        if self.task_embeddings is not None:  # the task token is no word: text and attentions align with input_ids again
            text = without_task_token(text, 1)  # (B, T, H)
            if output_attentions:
                attentions = [without_task_token(without_task_token(p, -2), -1) for p in attentions]
                cross = [without_task_token(p, -2) for p in cross]
        return EncoderOutput(
            text=text,
            image=image[:, 1:],
            pooled=pooled,
            attentions=tuple(attentions) if output_attentions else None,
            cross_attentions=tuple(p[..., 1:] for p in cross) if output_attentions else None,
        )

    def forward(self, input_ids, attention_mask, token_type_ids, region_features, region_boxes, region_mask,
                image_feature=None, tag_ids=None, output_attentions: bool = False,
                task_token: int | None = None) -> EncoderOutput:
        text = self.encode_text(input_ids, attention_mask, token_type_ids, output_attentions, task_token)
        image = self.encode_image(region_features, region_boxes, region_mask, image_feature)
        return self.fuse(text, image, output_attentions)
