"""Pretraining objectives as small pure functions: masking, label construction, image-text pairing, losses.

Every random choice draws from the `torch.Generator` passed in (on the tensors' device), so a batch's
masks are a function of (batch, generator state): seeded and resumable. Label formats are those of the
heads in `models/heads.py`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models import EncoderConfig, VLInputs, VLModel

PRETRAINING_KINDS = ("mlm", "mrfr", "mrc", "itm", "image_qa", "tag")
IGNORE = -100  # label of a position that does not count (the heads' ignore index)


@dataclass(frozen=True)
class TokenIds:
    """The ids masking needs: special tokens are never masked nor drawn as random replacements."""

    mask_id: int
    pad_id: int
    cls_id: int
    sep_id: int
    vocab_size: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TokenIds:
        """From a `models.tokenizer.VLTokenizer`."""
        return cls(tokenizer.mask_id, tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, len(tokenizer.vocab))

    @classmethod
    def from_config(cls, enc: EncoderConfig) -> TokenIds:
        return cls(enc.mask_token_id, enc.pad_token_id, enc.cls_token_id, enc.sep_token_id, enc.vocab_size)

    @property
    def specials(self) -> tuple[int, ...]:
        return tuple(sorted({self.mask_id, self.pad_id, self.cls_id, self.sep_id}))


def select_positions(candidates: torch.Tensor, generator: torch.Generator, prob: float) -> torch.Tensor:
    """Bernoulli(prob) choice among `candidates` (..., L) bool, with at least one per row that has a candidate.

    A row left empty gets one candidate chosen uniformly, so short rows never yield a step without a target.
    """
    draw = torch.rand(candidates.shape, generator=generator, device=candidates.device)
    chosen = (draw < prob) & candidates
    # A second draw, taken every call so the generator advances the same whatever the data.
    fallback = torch.rand(candidates.shape, generator=generator, device=candidates.device).masked_fill(~candidates, -1.0)
    empty = candidates.any(-1, keepdim=True) & ~chosen.any(-1, keepdim=True)  # (..., 1)
    forced = torch.zeros_like(chosen).scatter_(-1, fallback.argmax(-1, keepdim=True), True)
    return chosen | (forced & empty)


def random_regular_ids(shape: torch.Size, ids: TokenIds, generator: torch.Generator, device=None) -> torch.Tensor:
    """Token ids drawn uniformly from the vocabulary without the special tokens."""
    draw = torch.randint(0, ids.vocab_size - len(ids.specials), shape, generator=generator, device=device)
    for special in ids.specials:  # ascending: shift past each special id in turn
        draw += (draw >= special).long()
    return draw


def mask_tokens(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, tokenizer_ids: TokenIds, generator: torch.Generator, prob: float = 0.15,
    only: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked LM inputs and labels with BERT's 80/10/10 rule (Devlin et al. 2019, "BERT"), as every seed system.

    Of the real non-special tokens, each is chosen with `prob` (at least one per row that has any); a chosen
    token becomes [MASK] 80% of the time, a random regular token 10%, and stays itself 10%. Returns
    (masked input_ids, labels): the original id where chosen, -100 elsewhere. Works on (..., T).
    `only` (1-D token ids) restricts the choice to those tokens, e.g. the words the detector names
    (`grounded_token_ids`); a row without any of them gets no label.
    """
    specials = torch.tensor(tokenizer_ids.specials, device=input_ids.device)
    candidates = attention_mask.bool() & ~torch.isin(input_ids, specials)
    if only is not None:
        candidates &= torch.isin(input_ids, only.to(input_ids.device))
    chosen = select_positions(candidates, generator, prob)
    labels = input_ids.masked_fill(~chosen, IGNORE)
    roll = torch.rand(input_ids.shape, generator=generator, device=input_ids.device)
    replacements = random_regular_ids(input_ids.shape, tokenizer_ids, generator, input_ids.device)
    masked = torch.where(chosen & (roll < 0.8), tokenizer_ids.mask_id, input_ids)
    masked = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), replacements, masked)
    return masked, labels


def grounded_token_ids(tokenizer, words: list[str]) -> torch.Tensor:
    """Sorted ids of every sub-word of `words` and of their plurals ("circle", "circles"): the words an image decides.

    With the detector's class and attribute names, masked LM restricted to them (`mask_tokens(only=...)`) can only
    be solved by reading the image, as ERNIE-ViL's object and attribute prediction (Yu et al. 2021).
    """
    ids = {i for word in words for form in (word, word + "s") for i in tokenizer.token_ids(form)}
    return torch.tensor(sorted(ids), dtype=torch.long)


def mask_regions(
    region_features: torch.Tensor, region_mask: torch.Tensor, generator: torch.Generator, prob: float = 0.15
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Masked region modelling inputs: chosen real regions get zero features (LXMERT, Tan & Bansal 2019; ViLBERT).

    Each real region is chosen with `prob` (at least one per row that has any); padding never is.
    Returns (masked features (B, N, D), mrfr labels {"features": the originals, "mask": (B, N) bool}, mask).
    A whole-image feature computed from the regions must be recomputed from the masked ones (VL-BERT's
    encoder does so when `image_feature` is None).
    """
    mask = select_positions(region_mask.bool(), generator, prob)  # (B, N)
    masked = region_features.masked_fill(mask.unsqueeze(-1), 0.0)  # (B, N, D)
    return masked, {"features": region_features, "mask": mask}, mask


def region_class_labels(
    classes: torch.Tensor, mask: torch.Tensor, mode: str = "ce", num_classes: int | None = None
) -> torch.Tensor:
    """Masked region classification targets for the mrc head (LXMERT's RoI-feature classification; ViLBERT's KL).

    `classes` is either detector class ids (B, N) (-1 = no label) or detector class distributions (B, N, C).
    ce: (B, N) class ids (argmax of a distribution), -100 where not masked or unlabelled.
    kl: (B, N, C) distribution rows, normalised, zeros where not masked; ids become one-hot rows (needs
    `num_classes`).
    """
    mask = mask.bool()
    is_distribution = classes.is_floating_point()
    if mode == "ce":
        ids = classes.argmax(-1) if is_distribution else classes.long()
        return ids.masked_fill(~mask | (ids < 0), IGNORE)
    if mode != "kl":
        raise ValueError(f"mrc mode must be 'ce' or 'kl', not {mode!r}")
    if is_distribution:
        dist = classes.clamp(min=0)
    else:
        if num_classes is None:
            raise ValueError("kl labels from class ids need num_classes")
        dist = F.one_hot(classes.long().clamp(min=0), num_classes).float() * (classes >= 0).unsqueeze(-1)
    dist = dist / dist.sum(-1, keepdim=True).clamp(min=1e-12)
    return dist * mask.unsqueeze(-1)  # (B, N, C)


def itm_pairs(
    batch_size: int, generator: torch.Generator, prob_mismatch: float = 0.5, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image-text matching pairs (ViLBERT, LXMERT: replace the image with another one half of the time).

    Returns (image_index (B,), labels (B,) 1 = match, 0 = mismatch): row i's text goes with image
    image_index[i]. Mismatched rows never keep their own image: they swap images among themselves by a
    uniformly random derangement, so image_index is a permutation; the one exception is a single
    mismatched row, which borrows another row's image. A batch of one has no other image: always a match.
    """
    mismatched = torch.rand(batch_size, generator=generator, device=device) < prob_mismatch
    if batch_size < 2:
        mismatched[:] = False
    index = torch.arange(batch_size, device=device)
    rows = mismatched.nonzero().flatten()
    if len(rows) == 1:
        index[rows] = (rows + torch.randint(1, batch_size, (1,), generator=generator, device=device)) % batch_size
    elif len(rows) > 1:
        while True:  # rejection sampling: a uniform derangement after e tries on average
            perm = torch.randperm(len(rows), generator=generator, device=device)
            if not (perm == torch.arange(len(rows), device=device)).any():
                break
        index[rows] = rows[perm]
    return index, (~mismatched).long()


def with_images(inputs: VLInputs, image_index: torch.Tensor) -> VLInputs:
    """`inputs` whose row i carries the image (regions, tags, whole-image feature) of row image_index[i]."""
    take = lambda t: None if t is None else t[image_index]  # noqa: E731
    return inputs.replace(
        region_features=take(inputs.region_features), region_boxes=take(inputs.region_boxes),
        region_mask=take(inputs.region_mask), image_feature=take(inputs.image_feature), tag_ids=take(inputs.tag_ids),
    )


def image_qa_labels(vqa_scores: torch.Tensor, matched: torch.Tensor) -> torch.Tensor:
    """Image QA targets (LXMERT): the soft answer scores (B, A), zeroed on mismatched pairs.

    LXMERT asks the question only of the matched image; its loss ignores the other rows, whereas the soft
    score BCE of the image_qa head reads a zero row as "no answer is right".
    """
    return vqa_scores * matched.to(vqa_scores.dtype).unsqueeze(-1)


def text_only_batch(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None, *, visual_feat_dim: int
) -> VLInputs:
    """A U-VisualBERT text-only batch (Li et al. 2021, "Unsupervised Vision-and-Language Pre-training").

    There is no image: each row gets one padding region (zero features and box, region_mask 0, no tag),
    so every preset's shapes hold (a region axis of length 0 would not) and attention never reaches it.
    """
    b = input_ids.shape[0]
    return VLInputs(
        input_ids=input_ids,
        attention_mask=attention_mask,
        token_type_ids=torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids,
        region_features=torch.zeros(b, 1, visual_feat_dim, device=input_ids.device),
        region_boxes=torch.zeros(b, 1, 4, device=input_ids.device),
        region_mask=torch.zeros(b, 1, dtype=torch.long, device=input_ids.device),
        tag_ids=torch.full((b, 1), -1, dtype=torch.long, device=input_ids.device),
    )


def image_only_batch(
    region_features: torch.Tensor,
    region_boxes: torch.Tensor,
    region_mask: torch.Tensor,
    tag_ids: torch.Tensor | None = None,
    *,
    tokenizer_ids: TokenIds,
    image_feature: torch.Tensor | None = None,
) -> VLInputs:
    """A U-VisualBERT image-only batch: regions (and their detector tags, the anchors) with text `[CLS] [SEP]`.

    The two text tokens stay real (attention_mask 1): [CLS] feeds the pooler and every row keeps a query.
    """
    b, device = region_features.shape[0], region_features.device
    ids = torch.tensor([tokenizer_ids.cls_id, tokenizer_ids.sep_id], device=device).expand(b, 2).clone()
    return VLInputs(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        token_type_ids=torch.zeros_like(ids),
        region_features=region_features,
        region_boxes=region_boxes,
        region_mask=region_mask,
        image_feature=image_feature,
        tag_ids=tag_ids,
    )


def mask_tags(
    tag_ids: torch.Tensor, region_mask: torch.Tensor, generator: torch.Generator, prob: float = 0.15, mask_id: int = 103
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tag reconstruction (U-VisualBERT): chosen detector tags become [MASK]; the tag head predicts them.

    Each tag of a real region (id >= 0) is chosen with `prob`, at least one per row that has any; tag_ids is (B, N),
    or (B, N, K) every sub-word of each region's tag (u-visualbert's published embeddings), each sub-word a tag here.
    Returns (masked tag_ids, labels: the tag id where chosen, -100 elsewhere).
    """
    real = region_mask.bool().unsqueeze(-1).expand_as(tag_ids) if tag_ids.dim() > region_mask.dim() else region_mask.bool()
    candidates = (real & (tag_ids >= 0)).flatten(1)  # (B, N*K): at least one per row, over all its sub-words
    chosen = select_positions(candidates, generator, prob).reshape(tag_ids.shape)
    return tag_ids.masked_fill(chosen, mask_id), tag_ids.masked_fill(~chosen, IGNORE)


def pretraining_losses(
    model: VLModel, inputs: VLInputs, targets: Mapping[str, object], weights: Mapping[str, float] | None = None
) -> dict[str, torch.Tensor]:
    """One encoder pass, then the loss of every pretraining head of `model` that has targets, and their total.

    `targets` and `weights` are keyed by task (head) name; a missing weight is 1. LXMERT's
    visual_loss_normalizer (6.67 = 1 / 0.15) turns its mean over all regions into a mean over the masked
    ones; the heads here already average over masked positions, so LXMERT's balance is all weights 1.
    Returns {task: loss, ..., "total": weighted sum}.
    """
    weights = dict(weights or {})
    for name, given in (("targets", targets), ("weights", weights)):
        unknown = set(given) - set(model.heads)
        if unknown:
            raise KeyError(f"{name} for tasks the model has no head for: {', '.join(sorted(unknown))}")
    tasks = [t for t, h in model.config.heads.items() if h.kind in PRETRAINING_KINDS and t in targets]
    if not tasks:
        raise ValueError(f"no pretraining head ({', '.join(PRETRAINING_KINDS)}) of the model has targets")
    enc = model.forward_features(inputs)
    losses = {t: model.heads[t].training_loss(enc, inputs, targets[t]) for t in tasks}
    losses["total"] = sum(weights.get(t, 1.0) * loss for t, loss in losses.items())
    return losses


def group_ranking_loss(match_logits: torch.Tensor, group_size: int, targets: torch.Tensor | None = None,
                       pointwise: bool = False) -> torch.Tensor:
    """Listwise ranking loss for retrieval: (G * K, 2) ITM [no match, match] logits of G captions, each scored
    against K images (its own at index targets[g], 0 by default) -> cross-entropy of the softmax over each
    group's match scores (match minus no-match logit, the score retrieval ranks by). The listwise loss does not
    change when every score of a group shifts; pointwise adds each pair's two-class cross-entropy (the true pair
    matches, the others do not), which anchors the scores so that sigmoid(score) reads as P(match)."""
    if match_logits.shape[0] % group_size:
        raise ValueError(f"{match_logits.shape[0]} pairs do not split into groups of {group_size}")
    scores = (match_logits[:, 1] - match_logits[:, 0]).float().view(-1, group_size)  # (G, K)
    if targets is None:
        targets = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    loss = F.cross_entropy(scores, targets)
    if pointwise:
        matches = F.one_hot(targets, group_size).flatten()  # (G * K,) 1 for each group's true pair
        loss = loss + F.cross_entropy(match_logits.float(), matches)
    return loss
