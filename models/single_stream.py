"""Single-stream encoders (early fusion): VisualBERT, VL-BERT and U-VisualBERT share one BERT stack.

They differ only in how text and regions become one embedded sequence; each preset has its embeddings class.
Sequence layout: [text (T)] [regions (N)] (+ [END] for VL-BERT).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import EncoderConfig
from .layers import (FeatureNorm, Packing, Pooler, ScaledLayerNorm, TextEmbeddings, TransformerLayer, additive_mask,
                     normalized_features)
from .outputs import EncoderOutput
from .spatial import sinusoidal_box_embedding


def whole_image_feature(region_features: torch.Tensor, region_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the real regions' features (B, D): the whole-image feature when the detector gave none."""
    m = region_mask.to(region_features.dtype).unsqueeze(-1)  # (B, N, 1)
    return (region_features * m).sum(1) / m.sum(1).clamp(min=1.0)


class VisualBertEmbeddings(TextEmbeddings):
    """VisualBERT: region feature -> linear projection + visual segment + visual position (no box geometry)."""

    def __init__(self, config: EncoderConfig):
        super().__init__(config.vocab_size, config.hidden_size, config.max_position_embeddings, config.type_vocab_size, config.pad_token_id)
        h = config.hidden_size
        self.visual_token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.visual_position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.visual_projection = nn.Linear(config.visual_feat_dim, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def region_segment_position(self) -> torch.Tensor:
        """Segment 1 and position 0 for every region, as the authors' code (no word alignment at inference): (H,)."""
        return self.visual_token_type_embeddings.weight[1] + self.visual_position_embeddings.weight[0]

    def visual(self, region_features, region_boxes, image_feature, tag_ids) -> torch.Tensor:
        return self.visual_projection(region_features) + self.region_segment_position()  # (B, N, H)

    def forward(self, input_ids, attention_mask, token_type_ids, region_features, region_boxes, region_mask, image_feature=None, tag_ids=None):
        text = super().forward(input_ids, token_type_ids)  # (B, T, H)
        vis = self.visual(region_features, region_boxes, image_feature, tag_ids)  # (B, N, H)
        x = self.dropout(self.LayerNorm(torch.cat([text, vis], dim=1)))  # (B, T+N, H)
        return x, torch.cat([attention_mask, region_mask], dim=1)


class UVisualBertEmbeddings(VisualBertEmbeddings):
    """U-VisualBERT: VisualBERT's regions plus box geometry and the detector tags (tag_ids (B, N) one word per region,
    or (B, N, T) several: class and attribute words), embedded with the word table and summed."""

    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        self.geometry_width = config.geometry_width
        h = config.hidden_size
        if config.box_embedding == "linear":
            self.box_projection = nn.Linear(4, h)
        else:  # "normalized": features and sin/cos box geometry, each projected and layer-normalised
            self.visual_layer_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
            self.box_projection = nn.Linear(config.geometry_width, h)
            self.box_layer_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.normalized_boxes = config.box_embedding == "normalized"

    def visual(self, region_features, region_boxes, image_feature, tag_ids) -> torch.Tensor:
        if self.normalized_boxes:
            geometry = self.box_layer_norm(self.box_projection(sinusoidal_box_embedding(region_boxes, self.geometry_width)))
            vis = self.visual_layer_norm(self.visual_projection(region_features)) + geometry
        else:
            vis = self.visual_projection(region_features) + self.box_projection(region_boxes)
        vis = vis + self.region_segment_position()  # (B, N, H)
        if tag_ids is not None:
            tags = tag_ids if tag_ids.dim() == region_boxes.dim() else tag_ids.unsqueeze(-1)  # (B, N, T) words per region
            has_tag = (tags >= 0).unsqueeze(-1)  # (B, N, T, 1); -1 = no tag in that slot
            vis = vis + (self.word_embeddings(tags.clamp(min=0)) * has_tag).sum(2)
        return vis  # (B, N, H)


class VLBertEmbeddings(TextEmbeddings):
    """VL-BERT: every token also gets a visual feature embedding FC([RoI feature; sin/cos box geometry]).

    Text tokens and [END] see the whole image; [IMG] tokens see their region. Regions share one position
    (right after the real text) and segment C (index 2).
    """

    def __init__(self, config: EncoderConfig):
        super().__init__(config.vocab_size, config.hidden_size, config.max_position_embeddings, config.type_vocab_size, config.pad_token_id)
        if config.type_vocab_size < 3:
            raise ValueError("vl-bert needs type_vocab_size >= 3 (segments A, B and C)")
        self.config = config
        self.visual_fc = nn.Linear(config.visual_feat_dim + config.geometry_width, config.hidden_size)
        # VL-BERT's visual_ln_text / visual_ln_object: the whole image's embedding on the text tokens, the regions' own
        self.visual_ln_text = ScaledLayerNorm(config.hidden_size, config.layer_norm_eps, config.visual_scale_init)
        self.visual_ln_object = ScaledLayerNorm(config.hidden_size, config.layer_norm_eps, config.visual_scale_init)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def visual_feature_embedding(self, features: torch.Tensor, norm_boxes: torch.Tensor) -> torch.Tensor:
        geometry = sinusoidal_box_embedding(norm_boxes, self.config.geometry_width)
        return self.visual_fc(torch.cat([features, geometry], dim=-1))

    def forward(self, input_ids, attention_mask, token_type_ids, region_features, region_boxes, region_mask, image_feature=None, tag_ids=None):
        b, t = input_ids.shape
        n = region_features.shape[1]
        cfg = self.config
        if image_feature is None:
            image_feature = whole_image_feature(region_features, region_mask)
        whole_box = region_boxes.new_tensor([0.0, 0.0, 1.0, 1.0]).expand(b, 4)
        whole = self.visual_ln_text(self.visual_feature_embedding(image_feature, whole_box)).unsqueeze(1)  # (B, 1, H)
        text = super().forward(input_ids, token_type_ids) + whole  # (B, T, H)

        text_len = attention_mask.sum(1, keepdim=True).long()  # (B, 1): regions sit right after the real text
        img_ids = torch.full((b, n), cfg.img_token_id, dtype=torch.long, device=input_ids.device)
        seg_c = torch.full_like(img_ids, 2)
        regions = super().forward(img_ids, seg_c, text_len.expand(b, n))
        regions = regions + self.visual_ln_object(self.visual_feature_embedding(region_features, region_boxes))  # (B, N, H)
        end_ids = torch.full((b, 1), cfg.end_token_id, dtype=torch.long, device=input_ids.device)
        end = super().forward(end_ids, seg_c[:, :1], text_len + 1) + whole  # (B, 1, H)

        x = self.dropout(self.LayerNorm(torch.cat([text, regions, end], dim=1)))  # (B, T+N+1, H)
        mask = torch.cat([attention_mask, region_mask, attention_mask.new_ones(b, 1)], dim=1)
        return x, mask


EMBEDDINGS = {"visualbert": VisualBertEmbeddings, "vl-bert": VLBertEmbeddings, "u-visualbert": UVisualBertEmbeddings}


class SingleStreamEncoder(nn.Module):
    pools_first_token = True  # forward(pooled_only=True): the pooler reads the first token, so the last layer may too

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        c = config
        self.embeddings = EMBEDDINGS[c.preset](c)
        self.layer = nn.ModuleList(
            TransformerLayer(c.hidden_size, c.num_heads, c.intermediate_size, c.dropout, c.attention_dropout, c.layer_norm_eps)
            for _ in range(c.num_layers)
        )
        self.pooler = Pooler(c.hidden_size, c.hidden_size)
        self.feature_norm = FeatureNorm(c.visual_feat_dim) if c.feature_norm else None

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor,  # (B, T) 1 = real token
        token_type_ids: torch.Tensor,  # (B, T)
        region_features: torch.Tensor,  # (B, N, D)
        region_boxes: torch.Tensor,  # (B, N, 4) normalized x1, y1, x2, y2
        region_mask: torch.Tensor,  # (B, N) 1 = real region
        image_feature: torch.Tensor | None = None,  # (B, D) whole-image feature (VL-BERT)
        tag_ids: torch.Tensor | None = None,  # (B, N) word ids of detector tags, -1 = none (U-VisualBERT)
        output_attentions: bool = False,
        pooled_only: bool = False,  # only `pooled` is wanted: the last layer runs for the first token alone
    ) -> EncoderOutput:
        region_features, image_feature = normalized_features(self.feature_norm, region_features, image_feature)
        x, mask = self.embeddings(input_ids, attention_mask, token_type_ids, region_features, region_boxes, region_mask, image_feature, tag_ids)
        bias = additive_mask(mask, x.dtype)
        # the layers' token-wise work on the real tokens alone (Packing); padding positions come out as zeros
        packing = Packing(mask) if Packing.worthwhile(mask) else None
        x = packing.pack(x) if packing else x
        # a traced or exported graph keeps every output (its callers may read any)
        pooled_only = pooled_only and not output_attentions and Packing.eager()
        attentions = []
        for layer in self.layer[:-1] if pooled_only else self.layer:
            x, probs = layer(x, bias, output_attentions, packing)
            if output_attentions:
                attentions.append(probs)
        if pooled_only:
            first = self.layer[-1](x, bias, False, packing, first_only=True)[0].unsqueeze(1)  # (B, 1, H)
            return EncoderOutput(text=None, image=None, pooled=self.pooler(first), sequence=None, sequence_mask=mask)
        x = packing.unpack(x) if packing else x
        t, n = input_ids.shape[1], region_features.shape[1]
        return EncoderOutput(
            text=x[:, :t],
            image=x[:, t : t + n],
            pooled=self.pooler(x),
            sequence=x,
            sequence_mask=mask,
            attentions=tuple(attentions) if output_attentions else None,
        )
