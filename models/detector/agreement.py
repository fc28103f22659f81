"""How closely one extraction of an image reproduces another (bfloat16 against float32, one runtime against
another): the regions both keep, and how alike their features are."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchvision.ops import box_iou

from ..region_features import RegionFeatures


@dataclass(frozen=True)
class Agreement:
    matched: float  # share of the first's regions that the second has too: a box at IoU >= iou, the same class
    min_cosine: float  # lowest cosine between the features of matched regions (1.0 when none matched)


def agreement(first: RegionFeatures, second: RegionFeatures, iou: float = 0.9) -> Agreement:
    """Match each region of `first`, in order, to the best-overlapping unmatched region of `second` of its class."""
    n, m = first.num_boxes, second.num_boxes
    if n == 0:
        return Agreement(1.0 if m == 0 else 0.0, 1.0)
    a, b = (torch.from_numpy(rf.boxes[:k]).double() for rf, k in ((first, n), (second, m)))
    overlap = np.nan_to_num(box_iou(a, b).numpy(), nan=0.0)  # two empty boxes: 0 / 0
    overlap[first.obj_ids[:n, None] != second.obj_ids[None, :m]] = 0.0
    taken, cosines = np.zeros(m, bool), []
    for i in range(n):
        row = np.where(taken, -1.0, overlap[i])
        j = int(row.argmax()) if m else -1
        if j >= 0 and row[j] >= iou:
            taken[j] = True
            fa, fb = first.features[i].astype(np.float64), second.features[j].astype(np.float64)
            cosines.append(float(fa @ fb / max(np.linalg.norm(fa) * np.linalg.norm(fb), 1e-12)))
    return Agreement(len(cosines) / n, min(cosines, default=1.0))
