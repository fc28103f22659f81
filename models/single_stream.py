"""Single-stream encoders (early fusion): VisualBERT, VL-BERT and U-VisualBERT share one BERT stack.

They differ only in how text and regions become one embedded sequence; each preset has its embeddings class.
Sequence layout: [text (T)] [regions (N)] (+ [END] for VL-BERT; + the whole-image token, then [END], for its
reference embeddings; none for VOLTA's, whose last region slot is its [END]).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import EncoderConfig
from .layers import (FeatureNorm, Packing, Pooler, ScaledLayerNorm, TextEmbeddings, TransformerLayer, additive_mask,
                     eager, normalized_features)
from .outputs import EncoderOutput
from .spatial import center_size_box_embedding, sinusoidal_box_embedding


def whole_image_feature(region_features: torch.Tensor, region_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the real regions' features (B, D): the whole-image feature when the detector gave none."""
    m = region_mask.to(region_features.dtype).unsqueeze(-1)  # (B, N, 1)
    return (region_features * m).sum(1) / m.sum(1).clamp(min=1.0)


def with_whole_image(region_features, region_boxes, region_mask, image_feature=None, last: bool = False):
    """The whole image as one more region, first (or `last`): its feature (the mean of the real regions' when the
    detector gives none), the whole-image box, always real -> features (B, 1+N, D), boxes (B, 1+N, 4), mask (B, 1+N)."""
    b = region_features.shape[0]
    if image_feature is None:
        image_feature = whole_image_feature(region_features, region_mask)
    whole_box = region_boxes.new_tensor([0.0, 0.0, 1.0, 1.0]).expand(b, 1, 4)
    parts = [(image_feature.unsqueeze(1), region_features), (whole_box, region_boxes),
             (region_mask.new_ones(b, 1), region_mask)]
    return tuple(torch.cat([x, whole] if last else [whole, x], dim=1) for whole, x in parts)


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


class PublishedUVisualBertEmbeddings(TextEmbeddings):
    """U-VisualBERT as its authors' code embeds its input (uclanlp/visualbert, unsupervised_visualbert, at the flags of
    its published configs: hybrid_embedding, use_bert_input_for_tags, disable_divide_2, no joint LayerNorm):

      text    LN(word + position)                       segment ids are ignored (the reference passes none)
      region  LN_v(FC(feature)) + LN_b(FC(4-d box))
      tag     LN_t(word(sub-word)) + LN_b(FC(its region's box))   one token per sub-word of a region's class name

    Sequence [text (T)] [regions (N)] [tags (N*K)]: tag_ids (B, N, K), -1 = no sub-word in that slot. The reference
    puts the tags before the regions; neither carries a position, so attention cannot tell the orders apart, and
    keeping the regions right after the text keeps every region reader's slice [T, T+N).
    """

    def __init__(self, config: EncoderConfig):
        super().__init__(config.vocab_size, config.hidden_size, config.max_position_embeddings, config.type_vocab_size, config.pad_token_id)
        h, eps = config.hidden_size, config.layer_norm_eps
        self.LayerNorm = nn.LayerNorm(h, eps=eps)  # text
        self.visual_projection = nn.Linear(config.visual_feat_dim, h)
        self.visual_layer_norm = nn.LayerNorm(h, eps=eps)
        self.box_projection = nn.Linear(4, h)
        self.box_layer_norm = nn.LayerNorm(h, eps=eps)
        self.tag_layer_norm = nn.LayerNorm(h, eps=eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids, attention_mask, token_type_ids, region_features, region_boxes, region_mask, image_feature=None, tag_ids=None):
        text = self.LayerNorm(super().forward(input_ids, torch.zeros_like(input_ids)))  # (B, T, H)
        boxes = self.box_layer_norm(self.box_projection(region_boxes))  # (B, N, H)
        parts = [text, self.visual_layer_norm(self.visual_projection(region_features)) + boxes]
        masks = [attention_mask, region_mask]
        if tag_ids is not None:
            tags = tag_ids if tag_ids.dim() == region_boxes.dim() else tag_ids.unsqueeze(-1)  # (B, N, K)
            b, n, k = tags.shape
            words = self.tag_layer_norm(self.word_embeddings(tags.clamp(min=0)))  # (B, N, K, H)
            parts.append((words + boxes.unsqueeze(2)).reshape(b, n * k, -1))  # (B, N*K, H)
            real = (tags >= 0) & region_mask.bool().unsqueeze(-1)  # a padded region has no tags
            masks.append(real.reshape(b, n * k).to(attention_mask.dtype))
        return self.dropout(torch.cat(parts, dim=1)), torch.cat(masks, dim=1)


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


class ReferenceVLBertEmbeddings(TextEmbeddings):
    """VL-BERT as its authors' code embeds its input (jackroos/VL-BERT: VisualLinguisticBert.embedding, FastRCNN's
    obj_downsample, the task modules' object_linguistic_embeddings, the datasets' whole-image box):

      visual(f, box) = ReLU(FC([sin/cos of the box's centre and size (geometry_width); feature f]))
      text    word + position + segment + LN_text(visual(whole image))
      image   object + position(text length) + segment C + LN_object(visual(whole image))   the whole image is a region
      region  object + position(text length) + segment C + LN_object(visual(region))
      [END]   end + position(text length + 1) + segment C                                    no visual embedding

    `object` and `end` are learned vectors of their own (not word embeddings). Sequence: [text (T)] [regions (N)]
    [image] [END]. The reference puts the image before the regions; they share one position and attention has no
    order, so the outputs are the same, and the regions stay where every region reader looks ([T, T+N)).
    The whole image's box is the image, [0, 0, 1, 1]; its feature is image_feature, else the mean of the regions'.
    """

    def __init__(self, config: EncoderConfig):
        super().__init__(config.vocab_size, config.hidden_size, config.max_position_embeddings, config.type_vocab_size, config.pad_token_id)
        if config.type_vocab_size < 3:
            raise ValueError("vl-bert needs type_vocab_size >= 3 (segments A, B and C)")
        h = config.hidden_size
        self.geometry_width = config.geometry_width
        self.visual_fc = nn.Linear(config.geometry_width + config.visual_feat_dim, h)
        self.visual_ln_text = ScaledLayerNorm(h, config.layer_norm_eps, config.visual_scale_init)
        self.visual_ln_object = ScaledLayerNorm(h, config.layer_norm_eps, config.visual_scale_init)
        self.object_embedding = nn.Embedding(1, h)
        self.end_embedding = nn.Embedding(1, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def visual(self, features: torch.Tensor, norm_boxes: torch.Tensor) -> torch.Tensor:
        geometry = center_size_box_embedding(norm_boxes, self.geometry_width)
        return torch.relu(self.visual_fc(torch.cat([geometry, features.to(geometry.dtype)], dim=-1)))

    def forward(self, input_ids, attention_mask, token_type_ids, region_features, region_boxes, region_mask, image_feature=None, tag_ids=None):
        b, n = input_ids.shape[0], region_features.shape[1]
        if image_feature is None:
            image_feature = whole_image_feature(region_features, region_mask)
        whole_box = region_boxes.new_tensor([0.0, 0.0, 1.0, 1.0]).expand(b, 1, 4)
        features = torch.cat([region_features, image_feature.unsqueeze(1).to(region_features.dtype)], dim=1)  # (B, N+1, D)
        visual = self.visual(features, torch.cat([region_boxes, whole_box], dim=1))  # (B, N+1, H)
        text = super().forward(input_ids, token_type_ids) + self.visual_ln_text(visual[:, n:])  # (B, T, H)

        text_len = attention_mask.sum(1, keepdim=True).long()  # (B, 1): the image sits right after the real text
        seg_c = torch.full((b, n + 2), 2, dtype=torch.long, device=input_ids.device)
        place = self.position_embeddings(torch.cat([text_len.expand(b, n + 1), text_len + 1], dim=1))  # (B, 1+N+1, H)
        place = place + self.token_type_embeddings(seg_c)
        regions = place[:, : n + 1] + self.object_embedding.weight + self.visual_ln_object(visual)  # (B, N+1, H)
        end = place[:, n + 1 :] + self.end_embedding.weight  # (B, 1, H)

        x = self.dropout(self.LayerNorm(torch.cat([text, regions, end], dim=1)))  # (B, T+N+2, H)
        ones = attention_mask.new_ones(b, 2)  # the image and [END]
        return x, torch.cat([attention_mask, region_mask.to(attention_mask.dtype), ones], dim=1)


class VoltaVLBertEmbeddings(ReferenceVLBertEmbeddings):
    """VL-BERT as e-bug/volta embeds its input (image_embeddings "vl-bert", v_hidden_size = hidden_size):

      visual(f, box) = ReLU(FC([sin/cos of the box's centre and size; f])), as the reference's; a slot whose feature is
                       all zeros (padding, or a region VOLTA masks) reads the learned mask_visual_embedding instead
      text    word + position + segment + LN_text(visual(the last region slot))
      region  object + position(text length) + segment C + LN_object(visual(region))
      last    end + position(text length + 1) + segment C + LN_object(visual(its region))

    VOLTA adds no tokens: the last slot of the padded region tensor is its [END], and its visual feature is the one
    every text token gets. VOLTA pads each image to max_region_num + 1 slots, which its published features (36
    regions and the whole image) fill, so there [END] is the last region; where an image has fewer regions than the
    batch, [END] is a padding slot (masked; the text then gets the mask embedding's visual feature), as in VOLTA.
    With whole_image_region the encoder appends the whole image after the regions where VOLTA puts it first: the
    region before it is VOLTA's last slot. Padding slots are zeroed first, as VOLTA's datasets pad them. Text
    positions are each example's own (VOLTA's batched call moves them from the batch's shortest text on, an in-place
    add through a batch-shared view: these are its outputs at batch size 1).
    """

    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        self.mask_visual_embedding = nn.Embedding(1, config.visual_feat_dim)
        self.end_slot = -2 if config.whole_image_region else -1

    def forward(self, input_ids, attention_mask, token_type_ids, region_features, region_boxes, region_mask, image_feature=None, tag_ids=None):
        n = region_features.shape[1]
        real = region_mask.bool().unsqueeze(-1)  # (B, N, 1)
        features = torch.where(real, region_features, torch.zeros_like(region_features))
        boxes = torch.where(real, region_boxes, torch.zeros_like(region_boxes))
        blank = (features == 0).all(-1, keepdim=True)  # (B, N, 1)
        features = torch.where(blank, self.mask_visual_embedding.weight[0].to(features.dtype), features)
        visual = self.visual(features, boxes)  # (B, N, H)
        end = n + self.end_slot
        text = TextEmbeddings.forward(self, input_ids, token_type_ids) + self.visual_ln_text(visual[:, end : end + 1])

        is_end = (torch.arange(n, device=input_ids.device) == end).unsqueeze(0)  # (1, N)
        text_len = attention_mask.sum(1, keepdim=True).long()  # (B, 1): the regions sit right after the real text
        place = self.position_embeddings(text_len + is_end.long()) + self.token_type_embeddings.weight[2]  # (B, N, H)
        token = torch.where(is_end.unsqueeze(-1), self.end_embedding.weight, self.object_embedding.weight)  # (1, N, H)
        regions = place + token + self.visual_ln_object(visual)  # (B, N, H)
        x = self.dropout(self.LayerNorm(torch.cat([text, regions], dim=1)))  # (B, T+N, H)
        return x, torch.cat([attention_mask, region_mask.to(attention_mask.dtype)], dim=1)


def vl_bert_embeddings(config: EncoderConfig) -> nn.Module:
    """The vl-bert embeddings its config names (EncoderConfig.vlbert_embedding)."""
    kinds = {"reference": ReferenceVLBertEmbeddings, "volta": VoltaVLBertEmbeddings}
    return kinds.get(config.vlbert_embedding, VLBertEmbeddings)(config)


EMBEDDINGS = {"visualbert": VisualBertEmbeddings, "vl-bert": vl_bert_embeddings, "u-visualbert": UVisualBertEmbeddings}


class SingleStreamEncoder(nn.Module):
    pools_first_token = True  # forward(pooled_only=True): the pooler reads the first token, so the last layer may too

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        c = config
        self.tag_tokens = c.embedding_style == "published"  # tags are tokens after the regions, not summed into them
        self.embeddings = PublishedUVisualBertEmbeddings(c) if self.tag_tokens else EMBEDDINGS[c.preset](c)
        self.layer = nn.ModuleList(
            TransformerLayer(c.hidden_size, c.num_heads, c.intermediate_size, c.dropout, c.attention_dropout, c.layer_norm_eps)
            for _ in range(c.num_layers)
        )
        self.pooler = Pooler(c.hidden_size, c.hidden_size) if c.pooler and c.pooler_style == "tanh" else None
        if c.pooler_style != "tanh":  # VOLTA's: ReLU poolers of their own width, the text's alone or times the image's
            self.t_pooler = Pooler(c.hidden_size, c.pooled_size, activation="relu")
            if c.pooler_style == "relu_mul":
                self.v_pooler = Pooler(c.hidden_size, c.pooled_size, activation="relu")
                self.pools_first_token = False  # it reads the whole-image token too
        self.feature_norm = FeatureNorm(c.visual_feat_dim) if c.feature_norm else None

    def pool(self, x: torch.Tensor, whole_at: int = 0) -> torch.Tensor:
        """The pooled vector (B, H) from the first token: through the pooler, or its hidden state where there is none."""
        if self.config.pooler_style != "tanh":
            pooled = self.t_pooler(x)  # (B, P)
            # the whole-image token follows the regions (pooled_only never runs here: pools_first_token is False)
            return pooled * self.v_pooler(x[:, whole_at:]) if self.config.pooler_style == "relu_mul" else pooled
        return self.pooler(x) if self.pooler is not None else x[:, 0]

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
        n = region_features.shape[1]
        if self.config.whole_image_region:  # VOLTA's controlled VisualBERT: the whole image as one more region, after
            # the others (VOLTA's goes first; regions share one position, so the order changes no output); its
            # feature is the mean of the regions', as VOLTA's feature readers make it, whatever the detector gives
            region_features, region_boxes, region_mask = with_whole_image(region_features, region_boxes, region_mask,
                                                                          last=True)
        x, mask = self.embeddings(input_ids, attention_mask, token_type_ids, region_features, region_boxes, region_mask, image_feature, tag_ids)
        bias = additive_mask(mask, x.dtype)
        # the layers' token-wise work on the real tokens alone (Packing); padding positions come out as zeros
        packing = Packing(mask) if Packing.worthwhile(mask) else None
        x = packing.pack(x) if packing else x
        # a traced or exported graph keeps every output (its callers may read any)
        pooled_only = pooled_only and not output_attentions and eager()
        attentions = []
        for layer in self.layer[:-1] if pooled_only else self.layer:
            x, probs = layer(x, bias, output_attentions, packing)
            if output_attentions:
                attentions.append(probs)
        if pooled_only:
            first = self.layer[-1](x, bias, False, packing, first_only=True)[0].unsqueeze(1)  # (B, 1, H)
            return EncoderOutput(text=None, image=None, pooled=self.pool(first), sequence=None, sequence_mask=mask)
        x = packing.unpack(x) if packing else x
        t = input_ids.shape[1]
        return EncoderOutput(
            text=x[:, :t],
            image=x[:, t : t + n],
            pooled=self.pool(x, t + n),
            sequence=x,
            sequence_mask=mask,
            attentions=tuple(attentions) if output_attentions else None,
            tags=x[:, t + n :] if self.tag_tokens and tag_ids is not None else None,
        )
