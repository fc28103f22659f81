"""Thin task and pretraining heads; every head works on every preset's EncoderOutput.

A head may reshape the batch before the encoder runs (`prepare`: NLVR2 image pairs, multiple-choice
candidates), maps the encoder output to logits (`forward`) and computes its loss (`loss`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ANSWER_POOLS, EncoderConfig, HeadConfig
from .inputs import VLInputs
from .outputs import EncoderOutput

NEG = -1e4  # logit given to padded regions / candidates: exp() underflows, but stays finite in fp16


def classifier(kind: str, width: int, out: int, eps: float, hidden: int = 0) -> nn.Module:
    """'linear', or LXMERT/ViLBERT's 'mlp': Linear(w, h) - GELU - LayerNorm - Linear(h, out), h = `hidden` or 2w, or
    'bert': Transform(w) then Linear(w, out)."""
    if kind == "linear":
        return nn.Linear(width, out)
    if kind == "bert":  # VL-BERT's VQA "mlm" classifier: BERT's prediction transform (width kept), then the answers
        return nn.Sequential(Transform(width, eps), nn.Linear(width, out))
    hidden = hidden or 2 * width
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.LayerNorm(hidden, eps=eps), nn.Linear(hidden, out))


def soft_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against a target distribution over the last axis (targets normalised here).

    Rows whose targets are all zero (no positive) do not count.
    """
    total = targets.sum(-1, keepdim=True)
    valid = total.squeeze(-1) > 0
    if not valid.any():
        return logits.sum() * 0.0
    dist = targets / total.clamp(min=1e-12)
    nll = -(dist * F.log_softmax(logits, dim=-1)).sum(-1)
    return nll[valid].mean()


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over (..., C) logits at positions whose label is not -100; 0 (not NaN) when none is."""
    labels = labels.flatten()
    if not (labels != -100).any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits.flatten(0, -2), labels, ignore_index=-100)


def vqa_soft_score_loss(logits: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Multi-label BCE on VQA soft scores, scaled by the answer count (bottom-up attention / LXMERT)."""
    return F.binary_cross_entropy_with_logits(logits, scores) * scores.shape[-1]


def with_attended_regions(region_query: nn.Linear, enc: EncoderOutput, region_mask: torch.Tensor) -> torch.Tensor:
    """The pooled vector joined with a pooled-vector-guided attention pooling of the contextual regions (B, P + Hv):
    the top-down attention of bottom-up/top-down VQA, a direct path from a head to the regions."""
    query = region_query(enc.pooled)  # (B, Hv)
    scores = torch.einsum("bnh,bh->bn", enc.image, query) / enc.image.shape[-1] ** 0.5  # (B, N)
    scores = scores.masked_fill(region_mask == 0, torch.finfo(scores.dtype).min)
    # times the mask: an image without regions pools zero, not the mean of its padding (whose states depend on
    # what else the batch held); where a row has a real region the masked weights are exactly 0 already
    weights = scores.softmax(-1) * (region_mask != 0).to(scores.dtype)
    pooled_regions = torch.einsum("bn,bnh->bh", weights, enc.image)  # (B, Hv)
    return torch.cat([enc.pooled, pooled_regions], dim=-1)


GEOMETRY_QUERIES = 4  # pool="regions_film": how many regions a question may locate at once


def located_boxes(where_query: nn.Linear, enc: EncoderOutput, region_mask: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """(B, K, 4) float32: the expected box under each of K pooled-vector-guided softmax attentions over the real regions."""
    b, n, hv = enc.image.shape
    query = where_query(enc.pooled).reshape(b, GEOMETRY_QUERIES, hv)  # (B, K, Hv)
    logits = torch.einsum("bnh,bkh->bkn", enc.image, query).float() / hv ** 0.5  # (B, K, N)
    weights = logits.masked_fill(region_mask[:, None, :] == 0, torch.finfo(logits.dtype).min).softmax(-1)
    weights = weights * (region_mask[:, None, :] != 0).to(weights.dtype)  # no regions: no box (0, 0, 0, 0)
    return torch.einsum("bkn,bnc->bkc", weights, boxes.float())


COUNT_QUERIES = 4  # pool="regions_film": how many region counts a question may take at once
COUNT_BINS = 16  # each count is also read as its closeness to 0, 1, ..., COUNT_BINS - 1


def region_counts(count_query: nn.Linear, enc: EncoderOutput, region_mask: torch.Tensor) -> torch.Tensor:
    """(B, K) float32: K pooled-vector-guided sigmoid gates over the real regions, each summed. A softmax attention
    averages: two red circles pool to the same vector as one, and a classifier cannot count them (Zhang et al.,
    "Learning to Count Objects in Natural Images for VQA", 2018); sigmoid gates add up instead."""
    b, n, hv = enc.image.shape
    query = count_query(enc.pooled)  # (B, K * Hv + K): K queries and K gate biases
    queries, bias = query[:, : COUNT_QUERIES * hv].reshape(b, COUNT_QUERIES, hv), query[:, COUNT_QUERIES * hv:]
    logits = torch.einsum("bnh,bkh->bkn", enc.image, queries).float() / hv ** 0.5 + bias.float()[:, :, None]
    return (torch.sigmoid(logits) * region_mask[:, None, :].float()).sum(-1)


def count_bumps(counts: torch.Tensor) -> torch.Tensor:
    """(B, K) counts -> (B, K * COUNT_BINS): each count's closeness to 0, 1, ..., COUNT_BINS - 1 (Gaussian, width 0.5)."""
    centres = torch.arange(COUNT_BINS, device=counts.device, dtype=counts.dtype)
    return torch.exp(-2.0 * (counts[:, :, None] - centres) ** 2).flatten(1)


PAIRS = [(i, j) for i in range(GEOMETRY_QUERIES) for j in range(i + 1, GEOMETRY_QUERIES)]  # located-region pairs
EXPLICIT = COUNT_QUERIES * (1 + COUNT_BINS) + GEOMETRY_QUERIES * 4 + 2 * len(PAIRS)  # width of explicit_features
MODULATED = 128  # pool="regions_film": width of the question-modulated explicit features


def explicit_features(counts: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """(B, EXPLICIT) float32: the counts and their bumps, each located region's centre (from the image centre) and
    size, and the centre offsets of every pair of located regions."""
    centres = (boxes[..., :2] + boxes[..., 2:]) / 2 - 0.5  # (B, K, 2)
    sizes = boxes[..., 2:] - boxes[..., :2]
    first, second = zip(*PAIRS)
    offsets = centres[:, list(first)] - centres[:, list(second)]  # (B, pairs, 2)
    return torch.cat([counts, count_bumps(counts), centres.flatten(1), sizes.flatten(1), offsets.flatten(1)], dim=-1)


def with_modulated_regions(region_query: nn.Linear, count_query: nn.Linear, where_query: nn.Linear, film: nn.ModuleDict,
                           enc: EncoderOutput, region_mask: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """with_attended_regions joined with the explicit features of counted and located regions (explicit_features)
    and their question-modulated projection (B, P + Hv + EXPLICIT + MODULATED): film["question"](pooled) *
    film["features"](explicit), elementwise.

    "Is A left of B?", "is A on the left?" and "is there not a circle?" are exclusive-ors of a word and a measured
    quantity: neither alone tells the answer, and an MLP over the concatenated inputs sat at chance on them for
    thousands of steps (docs/RESULTS.md, "Heads"). The product puts the word's sign on the quantity before the
    classifier sees it, as FiLM's question-conditioned feature modulation does (Perez et al., 2018).
    """
    attended = with_attended_regions(region_query, enc, region_mask)
    explicit = explicit_features(region_counts(count_query, enc, region_mask),
                                 located_boxes(where_query, enc, region_mask, boxes))
    modulated = film["question"](enc.pooled).float() * film["features"](explicit.to(enc.pooled.dtype)).float()
    return torch.cat([attended, explicit.to(attended.dtype), modulated.to(attended.dtype)], dim=-1)


def pooled_width(head: HeadConfig, enc: EncoderConfig) -> int:
    """Width of what a head reads: the pooled vector, with pool="regions" also the attended regions, and with
    pool="regions_film" also the explicit features and their question-modulated projection."""
    extra = {"regions": enc.image_width, "regions_film": enc.image_width + EXPLICIT + MODULATED}
    return enc.pooled_size + extra.get(head.pool, 0)


class Head(nn.Module):
    def __init__(self, head: HeadConfig, enc: EncoderConfig):
        super().__init__()
        self.head = head

    @property
    def pooled_only(self) -> bool:
        """Whether the head reads nothing of the encoder's output but the pooled vector (then the encoder may skip the
        last layer's work on every other token: SingleStreamEncoder's pooled_only)."""
        return False

    def prepare(self, inputs: VLInputs) -> VLInputs:
        return inputs

    def unprepare(self, logits: torch.Tensor, original: VLInputs) -> torch.Tensor:
        """Reshape logits computed on the prepared batch back to the caller's batch."""
        return logits

    def loss(self, logits: torch.Tensor, labels, inputs: VLInputs) -> torch.Tensor:
        return F.cross_entropy(logits, labels)

    def training_loss(self, enc: EncoderOutput, inputs: VLInputs, labels) -> torch.Tensor:
        """The loss straight from the encoder's output (training needs no logits): heads may skip unscored positions."""
        return self.loss(self(enc, inputs).float(), labels, inputs)  # float32 under bf16 autocast too


class VQAHead(Head):
    """Answer scores (B, A) from the pooled vector, from the [MASK] answer slot before the final [SEP], or
    ("regions") from the pooled vector joined with a question-guided attention pooling of the contextual regions
    (the top-down attention of bottom-up/top-down VQA): a direct path from the answer to the regions; or
    ("regions_film") with counts, located boxes and their question-modulated projection (with_modulated_regions)."""

    def __init__(self, head: HeadConfig, enc: EncoderConfig):
        super().__init__(head, enc)
        width = enc.hidden_size if head.pool in ANSWER_POOLS else pooled_width(head, enc)
        if head.pool in ("regions", "regions_film"):
            self.region_query = nn.Linear(enc.pooled_size, enc.image_width)
        if head.pool == "regions_film":
            self.where_query = nn.Linear(enc.pooled_size, GEOMETRY_QUERIES * enc.image_width)
            self.count_query = nn.Linear(enc.pooled_size, COUNT_QUERIES * (enc.image_width + 1))
            self.film = nn.ModuleDict({"question": nn.Linear(enc.pooled_size, MODULATED),
                                       "features": nn.Linear(EXPLICIT, MODULATED)})
        self.dropout = nn.Dropout(enc.dropout)
        self.cls = classifier(head.classifier, width, head.num_labels, enc.layer_norm_eps, head.classifier_hidden)

    @property
    def pooled_only(self) -> bool:
        return self.head.pool == "pooled"

    def forward(self, enc: EncoderOutput, inputs: VLInputs) -> torch.Tensor:
        if self.head.pool == "pooled":
            h = enc.pooled  # (B, P)
        elif self.head.pool == "regions":
            h = with_attended_regions(self.region_query, enc, inputs.region_mask)  # (B, P + Hv)
        elif self.head.pool == "regions_film":
            h = with_modulated_regions(self.region_query, self.count_query, self.where_query, self.film, enc,
                                       inputs.region_mask, inputs.region_boxes)
        else:
            slot = (inputs.attention_mask.sum(1) - 2).long()  # (B,) index of [MASK] before the last [SEP]
            h = enc.text[torch.arange(slot.shape[0], device=slot.device), slot]  # (B, H)
        return self.cls(self.dropout(h))  # (B, A)

    def loss(self, logits, labels, inputs):
        if self.head.vqa_loss == "ce":
            return soft_target_cross_entropy(logits, labels.to(logits.dtype))
        return vqa_soft_score_loss(logits, labels.to(logits.dtype))


class NLVR2Head(Head):
    """True/false logits (B, 2) for a statement about an image pair.

    pair: two encoder passes, the pooled outputs concatenated (LXMERT, ViLBERT). joint: one pass whose
    regions are both images' regions (VisualBERT's NLVR2 setting).
    """

    def __init__(self, head: HeadConfig, enc: EncoderConfig):
        super().__init__(head, enc)
        width = pooled_width(head, enc) * (2 if head.nlvr2_mode == "pair" else 1)
        if head.pool == "regions":
            self.region_query = nn.Linear(enc.pooled_size, enc.image_width)
        self.dropout = nn.Dropout(enc.dropout)
        self.cls = classifier(head.classifier, width, 2, enc.layer_norm_eps, head.classifier_hidden)

    def prepare(self, inputs: VLInputs) -> VLInputs:
        b = inputs.region_features.shape[0]
        if inputs.region_features.dim() != 4 or inputs.region_features.shape[1] != 2:
            raise ValueError("nlvr2 needs region tensors of shape (B, 2, N, ...): one set per image")
        if self.head.nlvr2_mode == "joint":
            join = lambda t: None if t is None else t.reshape(b, -1, *t.shape[3:])  # noqa: E731
            return inputs.replace(
                region_features=join(inputs.region_features), region_boxes=join(inputs.region_boxes),
                region_mask=join(inputs.region_mask), tag_ids=join(inputs.tag_ids), image_feature=None,
            )
        twice = lambda t: None if t is None else t.repeat_interleave(2, dim=0)  # noqa: E731
        flat = lambda t: None if t is None else t.reshape(2 * b, *t.shape[2:])  # noqa: E731
        return inputs.replace(
            input_ids=twice(inputs.input_ids), attention_mask=twice(inputs.attention_mask),
            token_type_ids=twice(inputs.token_type_ids), region_features=flat(inputs.region_features),
            region_boxes=flat(inputs.region_boxes), region_mask=flat(inputs.region_mask),
            image_feature=flat(inputs.image_feature), tag_ids=flat(inputs.tag_ids),
        )

    @property
    def pooled_only(self) -> bool:
        return self.head.pool != "regions"

    def forward(self, enc: EncoderOutput, inputs: VLInputs) -> torch.Tensor:
        pooled = enc.pooled  # (B, P) joint, (2B, P) pair (or P + Hv each with pool="regions")
        if self.head.pool == "regions":
            pooled = with_attended_regions(self.region_query, enc, inputs.region_mask)
        if self.head.nlvr2_mode == "pair":
            pooled = pooled.reshape(pooled.shape[0] // 2, -1)  # (B, 2P): left then right
        return self.cls(self.dropout(pooled))  # (B, 2)


class ReferHead(Head):
    """One score per region (B, N); padded regions get NEG. Targets: regions with IoU >= 0.5 to the gold box.
    classifier="dense_gelu": VL-BERT's RefCOCO+ head, a Linear-GELU transform before the score."""

    def __init__(self, head: HeadConfig, enc: EncoderConfig):
        super().__init__(head, enc)
        if head.classifier == "dense_gelu":
            self.transform = Transform(enc.image_width, enc.layer_norm_eps, norm=False)
        self.dropout = nn.Dropout(enc.dropout)
        self.score = nn.Linear(enc.image_width, 1)

    def forward(self, enc: EncoderOutput, inputs: VLInputs) -> torch.Tensor:
        regions = self.transform(enc.image) if self.head.classifier == "dense_gelu" else enc.image
        logits = self.score(self.dropout(regions)).squeeze(-1)  # (B, N)
        return logits.masked_fill(inputs.region_mask == 0, NEG)

    def loss(self, logits, labels, inputs):
        return soft_target_cross_entropy(logits, labels.to(logits.dtype) * inputs.region_mask)


class ITMHead(Head):
    """Image-text matching logits (B, 2) [no match, match]; retrieval ranks by their difference."""

    def __init__(self, head: HeadConfig, enc: EncoderConfig):
        super().__init__(head, enc)
        if head.pool == "regions":
            self.region_query = nn.Linear(enc.pooled_size, enc.image_width)
        self.seq_relationship = nn.Linear(pooled_width(head, enc), 2)

    @property
    def pooled_only(self) -> bool:
        return self.head.pool != "regions"

    def forward(self, enc: EncoderOutput, inputs: VLInputs) -> torch.Tensor:
        return self.match(enc, inputs.region_mask)

    def match(self, enc: EncoderOutput, region_mask: torch.Tensor) -> torch.Tensor:
        """(B, 2) from the encoder's output and the regions' mask (B, N), all a match reads: so a two-stream
        encoder's streams may be encoded apart and met for it (VLModel.match_streams)."""
        if self.head.pool == "regions":
            return self.seq_relationship(with_attended_regions(self.region_query, enc, region_mask))
        return self.seq_relationship(enc.pooled)


class MultipleChoiceHead(Head):
    """VCR-style: input_ids (B, C, T), one pass per candidate, softmax over candidates -> (B, C)."""

    def __init__(self, head: HeadConfig, enc: EncoderConfig):
        super().__init__(head, enc)
        self.dropout = nn.Dropout(enc.dropout)
        self.cls = nn.Linear(enc.pooled_size, 1)

    def prepare(self, inputs: VLInputs) -> VLInputs:
        if inputs.input_ids.dim() != 3:
            raise ValueError("multiple_choice needs input_ids of shape (B, C, T): one row per candidate")
        b, c, t = inputs.input_ids.shape
        # expand + reshape, not repeat_interleave(c): the dynamo ONNX exporter turns a symbolic repeat count
        # into a wrong Expand (graphs that fail for any batch > 1)
        per_choice = lambda x: None if x is None else x.unsqueeze(1).expand(b, c, *x.shape[1:]).flatten(0, 1)  # noqa: E731
        return inputs.replace(
            input_ids=inputs.input_ids.reshape(b * c, t), attention_mask=inputs.attention_mask.reshape(b * c, t),
            token_type_ids=inputs.token_type_ids.reshape(b * c, t),
            region_features=per_choice(inputs.region_features), region_boxes=per_choice(inputs.region_boxes),
            region_mask=per_choice(inputs.region_mask), image_feature=per_choice(inputs.image_feature),
            tag_ids=per_choice(inputs.tag_ids), phrase_index=None,
        )

    @property
    def pooled_only(self) -> bool:
        return True

    def forward(self, enc: EncoderOutput, inputs: VLInputs) -> torch.Tensor:
        return self.cls(self.dropout(enc.pooled)).squeeze(-1)  # (B*C,)

    def unprepare(self, logits: torch.Tensor, original: VLInputs) -> torch.Tensor:
        return logits.view(original.input_ids.shape[0], -1)  # (B, C)


class GroundingHead(Head):
    """Region-to-phrase scores (B, P, N): a phrase's last sub-word queries the regions (VisualBERT, Flickr30K)."""

    def __init__(self, head: HeadConfig, enc: EncoderConfig):
        super().__init__(head, enc)
        inner = enc.hidden_size // enc.num_heads  # one attention head of the encoder's head width
        self.query = nn.Linear(enc.hidden_size, inner)
        self.key = nn.Linear(enc.image_width, inner)

    def forward(self, enc: EncoderOutput, inputs: VLInputs) -> torch.Tensor:
        if inputs.phrase_index is None:
            raise ValueError("grounding needs phrase_index (B, P)")
        idx = inputs.phrase_index.clamp(min=0)  # (B, P)
        phrases = torch.gather(enc.text, 1, idx.unsqueeze(-1).expand(-1, -1, enc.text.shape[-1]))  # (B, P, H)
        q, k = self.query(phrases), self.key(enc.image)
        scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5  # (B, P, N)
        return scores.masked_fill(inputs.region_mask[:, None, :] == 0, NEG)

    def loss(self, logits, labels, inputs):
        valid = (inputs.phrase_index >= 0).unsqueeze(-1).to(logits.dtype)
        return soft_target_cross_entropy(logits, labels.to(logits.dtype) * valid * inputs.region_mask[:, None, :])


class Transform(nn.Module):
    """BERT prediction-head transform: dense - GELU - LayerNorm (without `norm`: dense - GELU, VL-BERT's MVRC one)."""

    def __init__(self, width: int, eps: float, norm: bool = True):
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.LayerNorm = nn.LayerNorm(width, eps=eps) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.dense(x))
        return self.LayerNorm(x) if self.LayerNorm is not None else x


class MaskedLMHead(Head):
    """Masked LM over text (B, T, V); decoder tied to the word embeddings. Labels: token ids, -100 = not masked.

    The `tag` kind applies the same prediction to the detector tags (U-VisualBERT tag reconstruction): at the region
    positions (B, N, V), or where the tags are tokens of their own (the published embeddings) at each of those,
    shaped as tag_ids (B, N, K, V).
    """

    def __init__(self, head: HeadConfig, enc: EncoderConfig, word_embeddings: nn.Embedding):
        super().__init__(head, enc)
        width = enc.image_width if head.kind == "tag" else enc.hidden_size
        self.transform = Transform(width, enc.layer_norm_eps)
        # ViLBERT's image stream is wider than the word table: project onto it before the tied decoder
        dim = word_embeddings.embedding_dim
        self.project = nn.Linear(width, dim) if width != dim else None
        self.bias = nn.Parameter(torch.zeros(enc.vocab_size))
        self._tied = [word_embeddings]  # a list, so the tied weight is not registered (saved) twice

    def decode(self, states: torch.Tensor) -> torch.Tensor:
        h = self.transform(states)
        if self.project is not None:
            h = self.project(h)
        return F.linear(h, self._tied[0].weight, self.bias)

    def states(self, enc: EncoderOutput, inputs: VLInputs) -> torch.Tensor:
        """The hidden states this head predicts from: text (B, T, H), regions (B, N, H) or tag tokens (B, N, K, H)."""
        if self.head.kind != "tag":
            return enc.text
        if enc.tags is None:
            return enc.image
        return enc.tags.reshape(*inputs.tag_ids.shape, -1)

    def forward(self, enc: EncoderOutput, inputs: VLInputs) -> torch.Tensor:
        return self.decode(self.states(enc, inputs))  # (B, L, V); tag tokens (B, N, K, V)

    def loss(self, logits, labels, inputs):
        return masked_cross_entropy(logits, labels)

    def training_loss(self, enc: EncoderOutput, inputs: VLInputs, labels) -> torch.Tensor:
        """Decode only the masked positions: the vocabulary projection of every position costs as much as the
        encoder, and the per-position transform makes the result the same."""
        states = self.states(enc, inputs)
        scored = labels != -100
        if not scored.any():
            return self.decode(states[:, :1]).sum() * 0.0  # keeps the graph (and the tied weight's grad) defined
        return F.cross_entropy(self.decode(states[scored]).float(), labels[scored])


class RegionFeatureHead(Head):
    """Masked region feature regression (B, N, D). Labels: {"features": (B, N, D), "mask": (B, N) 1 = masked}."""

    def __init__(self, head: HeadConfig, enc: EncoderConfig):
        super().__init__(head, enc)
        self.transform = Transform(enc.image_width, enc.layer_norm_eps)
        self.decoder = nn.Linear(enc.image_width, enc.visual_feat_dim)

    def forward(self, enc: EncoderOutput, inputs: VLInputs) -> torch.Tensor:
        return self.decoder(self.transform(enc.image))

    def loss(self, logits, labels, inputs):
        masked = labels["mask"].bool()
        if not masked.any():
            return logits.sum() * 0.0
        return F.smooth_l1_loss(logits[masked], labels["features"][masked].to(logits.dtype))


class RegionClassHead(Head):
    """Masked region classification (B, N, C).

    ce: labels (B, N) detector class ids, -100 = not masked. kl: labels (B, N, C) the detector's class
    distribution, rows of zeros = not masked (ViLBERT). classifier="dense_gelu": no LayerNorm in the transform
    (VL-BERT's MVRC head).
    """

    def __init__(self, head: HeadConfig, enc: EncoderConfig):
        super().__init__(head, enc)
        self.transform = Transform(enc.image_width, enc.layer_norm_eps, norm=head.classifier != "dense_gelu")
        self.decoder = nn.Linear(enc.image_width, head.num_labels)

    def forward(self, enc: EncoderOutput, inputs: VLInputs) -> torch.Tensor:
        return self.decoder(self.transform(enc.image))

    def loss(self, logits, labels, inputs):
        if self.head.mrc_loss == "ce":
            return masked_cross_entropy(logits, labels)
        rows = labels.sum(-1) > 0
        if not rows.any():
            return logits.sum() * 0.0
        return F.kl_div(F.log_softmax(logits[rows], -1), labels[rows].to(logits.dtype), reduction="batchmean")


def build_head(head: HeadConfig, enc: EncoderConfig, word_embeddings: nn.Embedding) -> Head:
    simple = {
        "vqa": VQAHead, "image_qa": VQAHead, "nlvr2": NLVR2Head, "refer": ReferHead, "itm": ITMHead,
        "multiple_choice": MultipleChoiceHead, "grounding": GroundingHead, "mrfr": RegionFeatureHead,
        "mrc": RegionClassHead,
    }
    if head.kind in ("mlm", "tag"):
        return MaskedLMHead(head, enc, word_embeddings)
    return simple[head.kind](head, enc)
