"""Evaluation metrics as small pure functions over tensors: VQA soft accuracy, IoU, refer, R@K, grounding."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from models.spatial import box_area


def vqa_soft_accuracy(pred_idx: torch.Tensor, scores: torch.Tensor) -> float:
    """Mean soft score (VQA: min(#humans who gave it / 3, 1)) of the predicted answer: (B,) ids, (B, A) scores."""
    return scores.gather(-1, pred_idx.long().unsqueeze(-1)).float().mean().item()


ANSWER_TYPES = ("yes/no", "number", "other")  # the official VQA evaluation's answer types


def answer_type(answer: str) -> str:
    """The VQA answer type of an answer: yes/no, number (digits) or other."""
    return "yes/no" if answer in ("yes", "no") else "number" if answer.isdigit() else "other"


def vqa_accuracy_by_type(pred_idx: torch.Tensor, scores: torch.Tensor, types: list[str]) -> dict[str, float]:
    """vqa_soft_accuracy of the examples of each answer type present (types: one per example), as the official
    VQA evaluation reports beside the overall number."""
    out = {}
    for t in ANSWER_TYPES:
        rows = torch.tensor([i for i, u in enumerate(types) if u == t], dtype=torch.long)
        if len(rows):
            out[t] = vqa_soft_accuracy(pred_idx[rows], scores[rows])
    return out


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of x1,y1,x2,y2 boxes a (..., 4) and b (..., 4), broadcast: `box_iou(a[:, None], b[None])` is pairwise."""
    lt = torch.maximum(a[..., :2], b[..., :2])
    rb = torch.minimum(a[..., 2:], b[..., 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = box_area(a) + box_area(b) - inter
    return torch.where(union > 0, inter / union.clamp(min=torch.finfo(inter.dtype).tiny), torch.zeros_like(inter))


def refer_accuracy(pred_boxes: torch.Tensor, gold_boxes: torch.Tensor, thresh: float = 0.5) -> float:
    """Referring expressions: fraction of predicted boxes (B, 4) with IoU >= thresh to the gold box (B, 4)."""
    return (box_iou(pred_boxes, gold_boxes) >= thresh).float().mean().item()


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of rows whose argmax is the label: NLVR2 (B, 2), multiple choice (B, C)."""
    return (logits.argmax(-1) == labels).float().mean().item()


def gold_ranks(scores: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """Rank (0 = first) of each row's best gold column: how many non-gold columns score at least as high.

    scores and gold (R, C); ties count against the gold, so constant scores rank it last. Rows without a
    gold column are left out.
    """
    best_gold = scores.masked_fill(~gold, float("-inf")).max(-1).values  # (R,)
    above = (scores.masked_fill(gold, float("-inf")) >= best_gold.unsqueeze(-1)).sum(-1)  # (R,)
    return above[gold.any(-1)]


def recall_at_k(score_matrix: torch.Tensor, gold: torch.Tensor, ks: Sequence[int] = (1, 5, 10)) -> dict[str, dict[int, float]]:
    """Retrieval R@K in both directions (as ViLBERT / Flickr30K): score_matrix (texts, images), gold (texts,).

    gold[t] is the image text t describes (several texts per image). text_to_image: the gold image is in
    the text's top K. image_to_text: at least one of the image's texts is in its top K (images without a
    text are left out). Returns {"text_to_image": {k: r}, "image_to_text": {k: r}}.
    """
    images = torch.arange(score_matrix.shape[1], device=gold.device)
    is_gold = gold.unsqueeze(-1) == images  # (texts, images)
    ranks = {"text_to_image": gold_ranks(score_matrix, is_gold), "image_to_text": gold_ranks(score_matrix.T, is_gold.T)}
    return {direction: {k: (r < k).float().mean().item() for k in ks} for direction, r in ranks.items()}


def grounding_hits(
    attention: torch.Tensor, word_to_gold_box: torch.Tensor, region_boxes: torch.Tensor, thresh: float = 0.5
) -> torch.Tensor:
    """(..., words) bool: the region a head attends to most from each word has IoU >= thresh with the word's gold box.

    attention (..., words, regions) over the real regions only, any leading dims (heads; layers, heads);
    word_to_gold_box (words, 4): row w is the gold box of word w; region_boxes (regions, 4).
    """
    picked = region_boxes[attention.argmax(-1)]  # (..., words, 4)
    return box_iou(picked, word_to_gold_box) >= thresh


def grounding_accuracy(
    attention: torch.Tensor, word_to_gold_box: torch.Tensor, region_boxes: torch.Tensor, thresh: float = 0.5
) -> torch.Tensor:
    """Entity grounding accuracy of every attention head as a word -> region classifier (...,), e.g. (heads,).

    Li et al. 2020, "What Does BERT with Vision Look At?": a head's prediction for a word is its
    most-attended region; correct when that region has IoU >= thresh with the word's gold box.
    Sum `grounding_hits` over sentences for a corpus-level number.
    """
    return grounding_hits(attention, word_to_gold_box, region_boxes, thresh).float().mean(-1)


def confidence_baseline_hits(
    region_scores: torch.Tensor, word_to_gold_box: torch.Tensor, region_boxes: torch.Tensor, thresh: float = 0.5
) -> torch.Tensor:
    """(words,) bool: the detector's most confident region (scores (regions,)) has IoU >= thresh with each gold box."""
    best = region_boxes[region_scores.argmax()]  # (4,): the same region for every word
    return box_iou(best.expand_as(word_to_gold_box), word_to_gold_box) >= thresh


def confidence_baseline_accuracy(
    region_scores: torch.Tensor, word_to_gold_box: torch.Tensor, region_boxes: torch.Tensor, thresh: float = 0.5
) -> float:
    """The grounding baseline of Li et al. 2020: every word picks the detector's most confident region."""
    return confidence_baseline_hits(region_scores, word_to_gold_box, region_boxes, thresh).float().mean().item()


def image_attention_fraction(attention: torch.Tensor, text_mask: torch.Tensor, region_mask: torch.Tensor) -> torch.Tensor:
    """Share of their attention that real text tokens put on real regions, averaged over the tokens (...,).

    attention (..., T, N): text queries over the region keys, rows as the softmax left them (single-stream rows
    also cover the text, so they put less than all of it on regions); text_mask (T,), region_mask (N,): 1 = real.
    Li et al. 2020 call a head with more than 20% "attending to the image".
    """
    mass = (attention * region_mask.to(attention.dtype)).sum(-1)  # (..., T)
    tokens = text_mask.to(attention.dtype)
    return (mass * tokens).sum(-1) / tokens.sum().clamp(min=1)
