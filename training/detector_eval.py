"""Detector evaluation: mAP@0.5 on shapes-world scenes, and single-shape recall on easy-VQA images."""
from __future__ import annotations

import numpy as np
import torch
from torchmetrics.detection import MeanAveragePrecision

from models.detector import RegionDetector
from models.detector.model import box_recall

from .data.shapes_cache import ShapesSplit
from .data.shapes_world import SHAPES


def evaluate_map(detector: RegionDetector, split: ShapesSplit, indices, batch_size: int = 16) -> dict[str, float]:
    """COCO-style mAP at IoU 0.5 (torchmetrics, pycocotools backend) and recall of the extracted regions."""
    detector.eval()
    metric = MeanAveragePrecision(iou_type="bbox", iou_thresholds=[0.5], backend="pycocotools")
    indices = [int(i) for i in indices]
    recalls = []
    for s in range(0, len(indices), batch_size):
        chunk = indices[s : s + batch_size]
        images = [np.asarray(split.image(i), dtype=np.uint8) for i in chunk]
        outputs = detector.analyze(images, batch_size)
        preds = [{k: v.cpu() for k, v in d.items()} for _, d in outputs]  # from the GPU, if the detector is there
        gold = []
        for i, (rf, _) in zip(chunk, outputs):
            objects = split.annotations[i]["objects"]
            boxes = torch.tensor([o["box"] for o in objects], dtype=torch.float32).reshape(-1, 4)
            gold.append({"boxes": boxes, "labels": torch.tensor([SHAPES.index(o["shape"]) for o in objects])})
            recalls.append(box_recall(torch.from_numpy(rf.boxes[: rf.num_boxes]), boxes))
        metric.update(preds, gold)
    result = metric.compute()
    return {"map50": round(float(result["map_50"]), 4), "region_recall50": round(float(np.mean(recalls)), 4),
            "images": len(indices)}


def foreground_box(image: np.ndarray, threshold: int = 40) -> np.ndarray | None:
    """Box (x1, y1, x2, y2) around pixels that differ from the corner (background) colour; None if none do."""
    diff = np.abs(image.astype(np.int16) - image[0, 0].astype(np.int16)).max(-1) > threshold
    ys, xs = np.nonzero(diff)
    if xs.size == 0:
        return None
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=np.float32)


def easy_vqa_shape_recall(detector: RegionDetector, image_paths, batch_size: int = 16) -> dict[str, float]:
    """Fraction of easy-VQA images whose single shape (the foreground box) is found at IoU >= 0.5.

    found: by any detection (score > det_score_thresh); confident: by a detection scoring >= 0.5;
    top1: by the most confident detection.
    """
    from .data.easy_vqa import load_image

    hits, confident, top1, total = 0, 0, 0, 0
    paths = list(image_paths)
    for s in range(0, len(paths), batch_size):
        images = [load_image(p) for p in paths[s : s + batch_size]]
        for image, det in zip(images, detector.detect(images, batch_size)):
            box = foreground_box(image)
            if box is None:
                continue
            total += 1
            gold = torch.from_numpy(box)[None]
            hits += box_recall(det["boxes"], gold) == 1.0
            confident += box_recall(det["boxes"][det["scores"] >= 0.5], gold) == 1.0
            top1 += box_recall(det["boxes"][:1], gold) == 1.0
    n = max(total, 1)
    return {"found": round(hits / n, 4), "confident": round(confident / n, 4), "top1": round(top1 / n, 4), "images": total}
