"""The region detector as one ONNX graph: backbone (+ FPN), RPN (NMS as an ONNX operator), RoIAlign (butd:
RoIPool and res5), box head and bottom-up-attention region selection (per-class NMS as one NonMaxSuppression over
classes; butd's argmax-nms one NonMaxSuppression over the best-class boxes), dynamic image size. Both detector
families export through the detector's own _heads and _decode.

Input: the resized, normalised image (1, 3, h, w) from models.detector.preprocess (not yet padded; the graph
pads it to the canvas as prepare_image does). Outputs, in resized-image pixels: boxes (k, 4), features (k, D),
obj_ids / obj_scores (k,), attr_ids / attr_scores (k,), image_feature (D,) when the config pools one.
`OnnxDetector.extract` (models/detector/onnx.py) maps them back to original pixels and pads them into RegionFeatures,
as RegionDetector.extract does. Batch 1 per run: images of different sizes never share a canvas anyway.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import nms

from models.detector import RegionDetector
from models.detector.onnx import OnnxDetector
from models.detector.preprocess import MIN_CANVAS_SIDE, prepare_image
from models.region_features import RegionFeatures
from models.repository import DEFAULT_OPSET

from .parity import nonfinite_mismatch

OUTPUTS = ("boxes", "features", "obj_ids", "obj_scores", "attr_ids", "attr_scores")


class PerClassNMS(torch.autograd.Function):
    """boxes (R, K, 4), scores (R, K) -> (R, K) 1.0 where a box survives NMS among its class's boxes."""

    @staticmethod
    def forward(ctx, boxes, scores, thresh: float):
        survive = torch.zeros_like(scores)
        for k in range(scores.shape[1]):
            survive[nms(boxes[:, k], scores[:, k], thresh), k] = 1.0
        return survive

    @staticmethod
    def symbolic(g, boxes, scores, thresh: float):
        def const(value, dtype):
            return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))

        per_class = g.op("Transpose", scores, perm_i=[1, 0])  # (K, R)
        # one NMS "batch" per class, so every class has its own boxes: boxes (K, R, 4), scores (K, 1, R)
        selected = g.op("NonMaxSuppression", g.op("Transpose", boxes, perm_i=[1, 0, 2]),
                        g.op("Unsqueeze", per_class, const([1], torch.int64)),
                        const([1 << 30], torch.int64), const([thresh], torch.float32))  # (M, 3): class, 0, box
        where = g.op("Gather", selected, const([0, 2], torch.int64), axis_i=1)  # (M, 2)
        count = g.op("Slice", g.op("Shape", selected), const([0], torch.int64), const([1], torch.int64))
        ones = g.op("ConstantOfShape", count, value_t=torch.tensor([1.0]))
        zeros = g.op("Mul", per_class, const(0.0, torch.float32))
        out = g.op("Transpose", g.op("ScatterND", zeros, where, ones), perm_i=[1, 0])
        out.setType(scores.type())
        return out


def padding(size, divisible: int, least: int = 1):
    """Zeros to add after `size` for the canvas prepare_image makes: size rounded up to a multiple, and at least
    `least` (the detectron2 family's MIN_CANVAS_SIDE: on a smaller canvas a strip's regions would not be the torch
    detector's, and a 1 px side fails in onnxruntime)."""
    if torch.is_tensor(size):
        return torch.clamp((torch.ceil(size.float() / divisible) * divisible).long(), min=least) - size
    return max(least, -(-size // divisible) * divisible) - size


class DetectorGraph(nn.Module):
    """RegionDetector._heads + _decode + region selection for one resized image, exportable with dynamic size."""

    def __init__(self, detector: RegionDetector):
        super().__init__()
        self.detector = detector

    def confidence(self, boxes: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RegionDetector._confidence as graph operators: (R,) confidence, (R,) class."""
        c = self.detector.config
        if c.selection == "argmax-nms":  # best_class_nms: -1 for the proposals one NMS over best-class boxes drops
            best, cls = scores.max(-1)
            best_boxes = boxes.gather(1, cls[:, None, None].expand(-1, 1, 4)).squeeze(1)  # (R, 4)
            kept = nms(best_boxes, best, c.region_nms_thresh)
            conf = torch.full_like(best, -1.0)
            conf[kept] = best[kept]
            return conf, cls
        # region_confidence: best score among the classes whose NMS the proposal survives (first such class on ties)
        surviving = torch.where(PerClassNMS.apply(boxes, scores, c.region_nms_thresh) > 0, scores, torch.zeros_like(scores))
        conf = surviving.max(-1).values
        return conf, torch.where(conf > 0, surviving.argmax(-1), scores.argmax(-1))

    def forward(self, image: torch.Tensor):
        det, c = self.detector, self.detector.config
        h, w = image.shape[2], image.shape[3]  # 0-d tensors while tracing: the sizes stay dynamic in the graph
        least = MIN_CANVAS_SIDE if c.resize == "detectron2" else 1  # prepare_image's rule for each family
        canvas = F.pad(image, (0, padding(w, c.size_divisible, least), 0, padding(h, c.size_divisible, least)))
        whole = None
        if c.image_feature:
            hw = torch._shape_as_tensor(image)[2:].float()
            whole = [torch.cat([torch.zeros(2), hw.flip(0)]).unsqueeze(0)]  # [0, 0, w, h], from the graph's input
        head = det._heads(canvas, [(h, w)], whole)[0]
        boxes, scores = det._decode(head, (h, w))  # (R, K, 4) resized pixels, (R, K)
        conf, cls = self.confidence(boxes, scores)
        # choose_regions: most confident first, ties by index (TopK's order, as a stable descending argsort)
        count = torch._shape_as_tensor(conf)[0]
        if c.adaptive:
            wanted = (conf >= c.conf_thresh).sum().clamp(min=c.min_boxes, max=c.max_boxes)
        else:
            wanted = torch.tensor(c.num_boxes)
        keep = torch.topk(conf, torch.minimum(count, wanted), sorted=True).indices
        if c.selection == "argmax-nms":
            keep = keep[conf[keep] >= 0]  # never a proposal the NMS suppressed
        obj_ids = cls[keep]
        chosen = boxes[keep, obj_ids]  # (k, 4) resized pixels
        attr_scores, attr_ids = det._attributes(head.attr_logits[keep])
        out = [chosen, head.features[keep], obj_ids, conf[keep], attr_ids, attr_scores]
        if c.image_feature:
            out.append(head.image_feature)  # (D,)
        return tuple(out)


def export_detector(detector: RegionDetector, path: str | Path, opset: int = DEFAULT_OPSET) -> list[str]:
    """Write the detector graph (fp32) to `path`; returns its output names."""
    detector = detector.float().eval()
    example = np.full((96, 128, 3), 200, np.uint8)
    example[20:70, 30:90] = (200, 30, 30)
    prepared = prepare_image(example, detector.config)
    rh, rw = prepared.resized_hw
    image = prepared.tensor[None, :, :rh, :rw].contiguous()
    names = [*OUTPUTS, *(["image_feature"] if detector.config.image_feature else [])]
    dynamic = {"image": {2: "height", 3: "width"}, **{n: {0: "regions"} for n in OUTPUTS}}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings: parity with the torch detector is what counts
        torch.onnx.export(DetectorGraph(detector).eval(), (image,), str(path), dynamo=False, opset_version=opset,
                          input_names=["image"], output_names=names, dynamic_axes=dynamic, do_constant_folding=True)
    return names


def canonical(rf: RegionFeatures) -> dict[str, np.ndarray]:
    """The real regions ordered by confidence (to 1e-4), then box. A blank image's proposals are translated
    copies whose confidences differ only by float rounding: torch and onnxruntime may rank them either way."""
    n = rf.num_boxes
    order = np.lexsort((*np.round(rf.boxes[:n], 3).T[::-1], -np.round(rf.obj_scores[:n], 4)))
    return {name: getattr(rf, name)[:n][order].astype(np.float32)
            for name in ("boxes", "features", "obj_ids", "attr_ids", "obj_scores", "attr_scores")}


def parity_images(seed: int = 0) -> list[np.ndarray]:
    """Images of several sizes and aspect ratios with coloured rectangles, two strips of noise whose resized short
    side is under the detectron2 family's smallest canvas (noise: flat colours along a strip make proposals that
    are translated copies of each other, tied as a blank image's), plus two blank ones."""
    rng = np.random.default_rng(seed)
    images = []
    for h, w in ((200, 150), (64, 300), (33, 47), (480, 640), (120, 120)):
        image = np.full((h, w, 3), rng.integers(150, 250), np.uint8)
        for _ in range(3):
            bh, bw = int(rng.integers(h // 6 + 1, h // 2 + 2)), int(rng.integers(w // 6 + 1, w // 2 + 2))
            y, x = int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1))
            image[y : y + bh, x : x + bw] = rng.integers(0, 255, 3)
        images.append(image)
    strips = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((4, 700), (700, 6))]
    return images + strips + [np.full((80, 90, 3), 128, np.uint8), np.zeros((64, 64, 3), np.uint8)]


def tie_prone(image: np.ndarray) -> bool:
    """A constant image: every proposal is a translated copy of the others, their scores tie to float rounding, and
    which copies survive NMS is decided by that rounding (the bottom-up-attention reference itself keeps other
    regions when run with another thread count). Only the count of its regions is well defined."""
    return bool(image.min() == image.max())


def difference(want: np.ndarray, got: np.ndarray) -> tuple[float, int]:
    """(largest abs difference over the values finite in both, count of values NaN or infinite on one side and not
    the same on the other): NaN compares false with any bound, so it is counted apart, as export.parity counts
    logits."""
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    both_finite = np.isfinite(want) & np.isfinite(got)
    worst = float(np.abs(want[both_finite] - got[both_finite]).max()) if both_finite.any() else 0.0
    return worst, int(nonfinite_mismatch(got, want).sum())


def detector_parity(detector: RegionDetector, exported: OnnxDetector, images: list[np.ndarray]) -> dict:
    """Worst differences of the exported detector's regions to the torch detector's over `images`, taken over the
    values finite in both; `nonfinite` counts the boxes, features, scores and image-feature values NaN or infinite
    on one side only. Of a tie-prone image only the region count is compared."""
    worst = {"boxes_px": 0.0, "features": 0.0, "scores": 0.0, "image_feature": 0.0}
    same_count = same_ids = nonfinite = 0
    for image, want, got in zip(images, detector.extract(images), exported.extract(images)):
        if want.num_boxes != got.num_boxes:
            continue
        same_count += 1
        if tie_prone(image):
            same_ids += 1
            continue
        w, g = canonical(want), canonical(got)
        same_ids += int(np.array_equal(w["obj_ids"], g["obj_ids"]) and np.array_equal(w["attr_ids"], g["attr_ids"]))
        pairs = [(key, w[name], g[name]) for key, name in
                 (("boxes_px", "boxes"), ("features", "features"), ("scores", "obj_scores"))]
        if want.image_feature is not None:
            pairs.append(("image_feature", want.image_feature, got.image_feature))
        for key, a, b in pairs:
            diff, count = difference(a, b)
            worst[key] = max(worst[key], diff)
            nonfinite += count
    return {**worst, "nonfinite": nonfinite, "same_region_count": same_count / len(images),
            "same_classes": same_ids / len(images), "images": [list(im.shape[:2]) for im in images],
            "tie_prone_images": sum(tie_prone(im) for im in images)}
