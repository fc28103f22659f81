"""Bottom-up attention region selection and standard detection post-processing (pure tensor functions)."""
from __future__ import annotations

import torch
from torchvision.ops import batched_nms, box_iou, nms


def region_confidence(boxes: torch.Tensor, scores: torch.Tensor, nms_thresh: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per proposal, its best class score among the classes for which it survives per-class NMS, and that class.

    boxes (R, K, 4) class-specific boxes, scores (R, K) foreground class probabilities -> (R,), (R,).
    A proposal suppressed for every class gets 0, so duplicates of one object rank last.
    """
    conf = torch.zeros(scores.shape[0], dtype=scores.dtype, device=scores.device)
    cls = scores.argmax(-1)
    for k in range(scores.shape[1]):
        keep = nms(boxes[:, k], scores[:, k], nms_thresh)
        better = scores[keep, k] > conf[keep]
        conf[keep[better]] = scores[keep[better], k]
        cls[keep[better]] = k
    return conf, cls


def best_class_nms(boxes: torch.Tensor, scores: torch.Tensor, nms_thresh: float) -> tuple[torch.Tensor, torch.Tensor]:
    """frcnn-vg's region confidence: each proposal's best class and that class's box, and one NMS over those boxes
    whatever their classes. boxes (R, K, 4), scores (R, K) -> (R,) best score for survivors, -1 for suppressed
    proposals (they are never chosen), and (R,) best class."""
    best, cls = scores.max(1)
    kept = nms(boxes[torch.arange(cls.shape[0], device=cls.device), cls], best, nms_thresh)
    conf = torch.full_like(best, -1.0)
    conf[kept] = best[kept]
    return conf, cls


def choose_regions(conf: torch.Tensor, num_boxes: int, adaptive: bool, min_boxes: int, max_boxes: int, thresh: float) -> torch.Tensor:
    """Indices of the regions to keep, most confident first: fixed top-N, or adaptive min..max above thresh.
    Regions of negative confidence (suppressed by best_class_nms) are never kept."""
    order = torch.argsort(conf, descending=True, stable=True)
    if adaptive:
        count = int((conf >= thresh).sum())
        count = max(min_boxes, min(max_boxes, count))
    else:
        count = num_boxes
    keep = order[: min(count, conf.shape[0])]
    return keep[conf[keep] >= 0]


def uncertain_choices(boxes: torch.Tensor, scores: torch.Tensor, nms_thresh: float, keep: torch.Tensor,
                      score_error: float, iou_error: float, conf_thresh: float | None = None,
                      exact: torch.Tensor | None = None) -> torch.Tensor:
    """Which proposals' part in frcnn-vg's choice (best_class_nms, then `keep`: the most confident first) could change
    if every score not `exact` were off by up to a relative `score_error` and every overlap of such a proposal by up
    to `iou_error`: (R,) True for a candidate (a proposal whose best score could reach the last one kept) that is
    not exact and whose best class is within the error of its second, whose score is within it of the last kept
    one's (or of `conf_thresh`, adaptive), or that overlaps another candidate where NMS could decide otherwise (their
    scores within the error above the NMS threshold, or their overlap within `iou_error` of it). Two estimates
    compared may each be off: the margin is the sum of their errors (an exact one's is 0)."""
    r = scores.shape[0]
    if r == 0 or keep.numel() == 0:
        return torch.zeros(r, dtype=torch.bool, device=scores.device)
    exact = torch.zeros(r, dtype=torch.bool, device=scores.device) if exact is None else exact
    err = torch.where(exact, 0.0, score_error).to(scores.dtype)  # (R,) each best score's relative error
    best, cls = scores.max(1)
    last, last_err = best[keep[-1]], err[keep[-1]]
    candidate = best >= last * (1 - err - last_err)

    def close(a: torch.Tensor, b: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
        return (a - b).abs() <= error * torch.maximum(a, b)

    found = close(best, last, err + last_err)  # near the cut: those, and the last kept itself when any other is
    found[keep[-1]] = False
    found[keep[-1]] = found.any()
    if scores.shape[1] > 1:
        top2 = scores.topk(2, dim=1).values
        found |= close(top2[:, 0], top2[:, 1], 2 * err)
    if conf_thresh is not None:
        found |= close(best, best.new_tensor(conf_thresh), 2 * err)
    idx = candidate.nonzero().flatten()
    chosen = boxes[idx, cls[idx]]
    iou = box_iou(chosen, chosen).fill_diagonal_(0.0)
    moves = ~(exact[idx, None] & exact[None, idx])  # the pair's overlap may be off
    pair_err = err[idx, None] + err[None, idx]
    order = (iou > nms_thresh - iou_error * moves) & close(best[idx, None], best[None, idx], pair_err)
    overlap = ((iou - nms_thresh).abs() <= iou_error) & moves
    found[idx] |= (order | overlap).any(1)
    return found & candidate & ~exact


def nearest_cut(idx: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor, limit: int) -> torch.Tensor:
    """The `limit` proposals of `idx` whose best score is nearest the last kept one's (the cut), nearest first."""
    best = scores[idx].max(1).values
    return idx[(best - scores[keep[-1]].max()).abs().argsort()[:limit]]


def nms_first(boxes: torch.Tensor, scores: torch.Tensor, thresh: float, limit: int, block: int = 512) -> torch.Tensor:
    """The first `limit` indices of torchvision.ops.nms(boxes, scores, thresh), the same ones in the same order,
    without suppressing the boxes after them. Greedy NMS keeps a box when no kept box of a higher score overlaps
    it by more than `thresh`, so the boxes are taken in score order `block` at a time: those a kept box overlaps
    dropped (box_iou is the kernel's IoU to the bit), then NMS among the rest of the block; until `limit` are kept.
    An RPN's 6,000 proposals to 300: about 1 ms instead of 80 (the full NMS keeps about 3,000)."""
    order = scores.argsort(descending=True, stable=True)  # the kernel's order
    kept = order[:0]
    for start in range(0, order.numel(), block):
        idx = order[start : start + block]
        if kept.numel():
            idx = idx[~(box_iou(boxes[idx], boxes[kept]) > thresh).any(1)]
        kept = torch.cat([kept, idx[nms(boxes[idx], scores[idx], thresh)]])
        if kept.numel() >= limit:
            break
    return kept[:limit]


def detections(boxes: torch.Tensor, scores: torch.Tensor, score_thresh: float, nms_thresh: float, max_dets: int = 100):
    """Standard per-class detections for evaluation: boxes (R, K, 4), scores (R, K) -> boxes, scores, 0-based labels."""
    k = scores.shape[1]
    labels = torch.arange(k, device=scores.device).expand_as(scores)
    boxes, scores, labels = boxes.reshape(-1, 4), scores.reshape(-1), labels.reshape(-1)
    keep = torch.where(scores > score_thresh)[0]
    boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
    wh = boxes[:, 2:] - boxes[:, :2]
    keep = torch.where((wh > 1e-2).all(dim=1))[0]
    boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
    keep = batched_nms(boxes, scores, labels, nms_thresh)[:max_dets]
    return boxes[keep], scores[keep], labels[keep]
