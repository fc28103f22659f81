"""Bottom-up attention region selection and standard detection post-processing (pure tensor functions)."""
from __future__ import annotations

import torch
from torchvision.ops import batched_nms, nms


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
