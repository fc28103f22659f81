"""RegionDetector: a Faster R-CNN whose box head also returns the pooled region feature, object-class logits and
attribute logits, in one of two families (DetectorConfig.family) behind one extraction path:
  efficientnet-fpn  torchvision Faster R-CNN parts on EfficientNet-Lite0 + FPN (vlserve's own, trainable)
  butd              the bottom-up-attention ResNet C4 detector of Visual Genome (butd.py; imported from frcnn-vg)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.roi_heads import RoIHeads, fastrcnn_loss
from torchvision.models.detection.rpn import RegionProposalNetwork, RPNHead
from torchvision.ops import box_iou, clip_boxes_to_image

from ..region_features import RegionFeatures
from .backbone import EfficientNetFPN
from .butd import ButdRoIHeads, ButdRPN, ResNetC4, fast_convolutions
from .config import DetectorConfig
from .preprocess import Prepared, group_by_canvas, prepare_image
from .roi_align import TrainingRoIAlign
from .select import best_class_nms, choose_regions, detections, region_confidence


@dataclass
class HeadOutputs:
    """Box-head outputs for one image's proposals, in resized-image coordinates."""

    proposals: torch.Tensor  # (R, 4)
    features: torch.Tensor  # (R, D)
    class_logits: torch.Tensor  # (R, K+1), column 0 = background (butd: column K)
    box_regression: torch.Tensor | None  # (R, 4 (K+1)) (butd: (R, 4K), no background box; None: best_boxes)
    attr_logits: torch.Tensor  # (R, A) (butd: (R, A+1))
    image_feature: torch.Tensor | None  # (D,)


class RegionDetector(nn.Module):
    def __init__(self, config: DetectorConfig, pretrained_backbone: bool = True):
        super().__init__()
        self.config = c = config
        if c.family == "butd":  # imported weights only: no pretrained backbone to load
            self.backbone = ResNetC4(c)
            self.rpn = ButdRPN(c, self.backbone.out_channels)
            self.roi_heads = ButdRoIHeads(c, self.backbone.out_channels)
            return
        self.backbone = EfficientNetFPN(c.fpn_channels, c.trainable_blocks, pretrained_backbone)
        anchors = AnchorGenerator(c.anchor_sizes, (c.aspect_ratios,) * len(c.anchor_sizes))
        self.rpn = RegionProposalNetwork(
            anchors, RPNHead(c.fpn_channels, anchors.num_anchors_per_location()[0]),
            fg_iou_thresh=0.7, bg_iou_thresh=0.3, batch_size_per_image=256, positive_fraction=0.5,
            pre_nms_top_n=dict(training=c.rpn_train_pre_nms_top_n, testing=c.rpn_pre_nms_top_n),
            post_nms_top_n=dict(training=c.rpn_train_post_nms_top_n, testing=c.rpn_post_nms_top_n),
            nms_thresh=c.rpn_nms_thresh,
        )
        num_classes = len(c.classes) + 1  # + background
        self.roi_heads = RoIHeads(
            # torchvision's MultiScaleRoIAlign; in training (CPU) its backward is matrix products, not a scalar loop
            TrainingRoIAlign(["0", "1", "2"], c.roi_size, sampling_ratio=2),
            TwoMLPHead(c.fpn_channels * c.roi_size**2, c.feature_dim),
            FastRCNNPredictor(c.feature_dim, num_classes),
            fg_iou_thresh=0.5, bg_iou_thresh=0.5, batch_size_per_image=c.box_batch_size_per_image,
            positive_fraction=0.25, bbox_reg_weights=None,
            score_thresh=c.det_score_thresh, nms_thresh=c.det_nms_thresh, detections_per_img=100,
        )
        self.attr_score = nn.Linear(c.feature_dim, max(1, len(c.attributes)))

    def for_serving(self, dtype: torch.dtype = torch.float32, settle: bool = True) -> bool:
        """Rewrite a butd detector into its serving form (butd.fast_convolutions: batch norms folded, channels-last,
        RoIPool as a gather, res5 in `dtype`: bfloat16 only where the CPU computes it natively; with bfloat16 and
        `settle`, the region choice settled in float32: ButdRoIHeads.settle); no-op and False for the
        efficientnet-fpn family, whose convolutions are a small share of its time. Inference only, irreversible."""
        if self.config.family != "butd":
            return False
        fast_convolutions(self.backbone, self.roi_heads, dtype, settle)
        return True

    @property
    def batch_gain(self) -> bool:
        """Whether images run together take less time each than one by one. Not the butd family's on a CPU: res5,
        92% of its work, runs one image at a time anyway and batching the backbone saves nothing (2.56 against 2.58 s a
        photo at batch 1 and 8, docs/BENCHMARKS.md), so a batch there only makes each image wait for the last."""
        return not (self.config.family == "butd" and next(self.parameters()).device.type == "cpu")

    @property
    def settles_regions(self) -> bool:
        """A bfloat16 res5 whose region choice is settled in float32 (its regions are float32's)."""
        return self.config.family == "butd" and self.roi_heads.exact_res5 is not None

    # ---- shared forward ----------------------------------------------------------------------------
    def _box_head(self, feats, boxes: list[torch.Tensor], image_sizes) -> torch.Tensor:
        pooled = self.roi_heads.box_roi_pool(feats, boxes, image_sizes)  # (R, C, roi, roi)
        return self.roi_heads.box_head(pooled)  # (R, D)

    def _heads(self, canvas: torch.Tensor, image_sizes: list[tuple[int, int]],
               whole_boxes: list[torch.Tensor] | None = None, every_box: bool = True) -> list[HeadOutputs]:
        """Box-head outputs per image. whole_boxes: each image's (1, 4) box [0, 0, w, h] for the whole-image feature
        (by default made from image_sizes; the exported graph passes boxes computed from the image's shape).
        every_box=False: a butd detector leaves out the box deltas (_decode then computes each proposal's best-class
        box only, all that frcnn-vg's region choice and its regions read)."""
        if self.config.image_feature and whole_boxes is None:
            whole_boxes = [canvas.new_tensor([[0.0, 0.0, w, h]]) for h, w in image_sizes]
        if self.config.family == "butd":
            res4 = self.backbone(canvas)
            proposals = self.rpn(res4, image_sizes)
            features = self.roi_heads.features(res4, proposals)  # (R, D)
            if self.roi_heads.exact_res5 is not None:  # res5 in bfloat16: the regions chosen made float32's
                features = self.roi_heads.settle(res4, proposals, image_sizes, features)
            class_logits, box_regression, attr_logits = self.roi_heads(features, every_box)
            whole = self.roi_heads.features(res4, whole_boxes) if self.config.image_feature else None  # (B, D)
            return self._per_image(proposals, features, class_logits, box_regression, attr_logits, whole)
        feats = self.backbone(canvas)
        proposals, _ = self.rpn(ImageList(canvas, image_sizes), feats)
        features = self._box_head(feats, proposals, image_sizes)
        class_logits, box_regression = self.roi_heads.box_predictor(features)
        attr_logits = self.attr_score(features)
        whole = self._box_head(feats, whole_boxes, image_sizes) if self.config.image_feature else None  # (B, D)
        return self._per_image(proposals, features, class_logits, box_regression, attr_logits, whole)

    @staticmethod
    def _per_image(proposals, features, class_logits, box_regression, attr_logits, whole) -> list[HeadOutputs]:
        """Split the batch's box-head rows into one HeadOutputs per image."""
        out, start = [], 0
        for i, props in enumerate(proposals):
            sl = slice(start, start + props.shape[0])
            start += props.shape[0]
            deltas = None if box_regression is None else box_regression[sl]
            out.append(HeadOutputs(props, features[sl], class_logits[sl], deltas, attr_logits[sl],
                                   None if whole is None else whole[i]))
        return out

    def _decode(self, head: HeadOutputs, resized_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Class-specific boxes (R, K, 4) clipped to the resized image, and foreground scores (R, K)."""
        if self.config.family == "butd":
            if head.box_regression is None:
                return self.roi_heads.best_boxes(head.features, head.proposals, head.class_logits, resized_hw)
            return self.roi_heads.decode(head.box_regression, head.proposals, head.class_logits, resized_hw)
        r, k1 = head.class_logits.shape
        # explicit shape: with zero proposals (R = 0) decode returns (0, 4 (K+1)), not (0, K+1, 4)
        boxes = self.roi_heads.box_coder.decode(head.box_regression, [head.proposals]).reshape(r, k1, 4)  # (R, K+1, 4)
        boxes = clip_boxes_to_image(boxes, resized_hw)
        scores = F.softmax(head.class_logits, -1)
        return boxes[:, 1:], scores[:, 1:]

    def _run(self, images: list[np.ndarray], batch_size: int, every_box: bool = True):
        """Yield (index, Prepared, HeadOutputs) per image, batching images that share a canvas size."""
        prepared = [prepare_image(im, self.config) for im in images]
        device = next(self.parameters()).device
        for _, idxs in group_by_canvas(prepared).items():
            for s in range(0, len(idxs), batch_size):
                chunk = idxs[s : s + batch_size]
                canvas = torch.stack([prepared[i].tensor for i in chunk]).to(device)
                heads = self._heads(canvas, [prepared[i].resized_hw for i in chunk], every_box=every_box)
                for i, head in zip(chunk, heads):
                    yield i, prepared[i], head

    # ---- inference ---------------------------------------------------------------------------------
    def _confidence(self, boxes: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(R,) region confidence and class, as config.selection says (negative: never chosen)."""
        if self.config.selection == "argmax-nms":
            return best_class_nms(boxes, scores, self.config.region_nms_thresh)
        return region_confidence(boxes, scores, self.config.region_nms_thresh)

    def _attributes(self, attr_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k,) best attribute probability and id: independent sigmoids, or butd's softmax over its attributes."""
        if self.config.family == "butd":
            return ButdRoIHeads.attributes(attr_logits)
        return torch.sigmoid(attr_logits).max(-1)

    def _regions(self, prep: Prepared, head: HeadOutputs, boxes: torch.Tensor, scores: torch.Tensor) -> RegionFeatures:
        """Bottom-up-attention selection: the most confident regions after NMS, in original pixels."""
        c = self.config
        conf, cls = self._confidence(boxes, scores)
        keep = choose_regions(conf, c.num_boxes, c.adaptive, c.min_boxes, c.max_boxes, c.conf_thresh)
        obj_scores, obj_ids = conf[keep], cls[keep]  # most confident first
        chosen = prep.to_original(boxes[keep, obj_ids])  # (k, 4)
        attr_scores, attr_ids = self._attributes(head.attr_logits[keep])
        return RegionFeatures(
            boxes=chosen.float().cpu().numpy(),
            features=head.features[keep].float().cpu().numpy(),
            obj_ids=obj_ids.cpu().numpy().astype(np.int64),
            obj_scores=obj_scores.float().cpu().numpy(),
            attr_ids=attr_ids.cpu().numpy().astype(np.int64),
            attr_scores=attr_scores.float().cpu().numpy(),
            image_hw=prep.original_hw,
            num_boxes=int(keep.shape[0]),
            image_feature=None if head.image_feature is None else head.image_feature.float().cpu().numpy(),
        ).pad_to(c.max_regions)

    def _detections(self, prep: Prepared, boxes: torch.Tensor, scores: torch.Tensor) -> dict[str, torch.Tensor]:
        b, s, lab = detections(boxes, scores, self.config.det_score_thresh, self.config.det_nms_thresh)
        return {"boxes": prep.to_original(b), "scores": s, "labels": lab}

    @torch.inference_mode()
    def analyze(self, images: list[np.ndarray], batch_size: int = 8, regions: bool = True, dets: bool = True):
        """One detector pass per image -> list of (RegionFeatures or None, detections dict or None)."""
        results: list = [None] * len(images)
        every_box = dets or self.config.selection != "argmax-nms"  # per-class NMS reads every class's box
        for i, prep, head in self._run(images, batch_size, every_box):
            boxes, scores = self._decode(head, prep.resized_hw)
            results[i] = (self._regions(prep, head, boxes, scores) if regions else None,
                          self._detections(prep, boxes, scores) if dets else None)
        return results

    @torch.inference_mode()
    def scored_proposals(self, image: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """What the region selection reads for one image: class-specific boxes (R, K, 4) in resized-image pixels and
        foreground class probabilities (R, K), one row per proposal."""
        ((_, prep, head),) = list(self._run([image], 1))
        return self._decode(head, prep.resized_hw)

    def extract(self, images: list[np.ndarray], batch_size: int = 8) -> list[RegionFeatures]:
        """Region features per image (padded to config.max_regions); batched output equals per-image output."""
        return [r for r, _ in self.analyze(images, batch_size, dets=False)]

    def detect(self, images: list[np.ndarray], batch_size: int = 8) -> list[dict[str, torch.Tensor]]:
        """Standard detections (boxes in original pixels, scores, 0-based labels) for mAP evaluation."""
        return [d for _, d in self.analyze(images, batch_size, regions=False)]

    # ---- training ----------------------------------------------------------------------------------
    def losses(self, images: list[np.ndarray], targets: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Training losses. targets: boxes (M, 4) original pixels, labels (M,) 0-based, attributes (M, A) multi-hot."""
        if self.config.family == "butd":
            raise NotImplementedError("a butd detector is imported (vlserve import frcnn-vg), not trained by vlserve")
        prepared = [prepare_image(im, self.config) for im in images]
        device = next(self.parameters()).device
        canvas = pad_stack([p.tensor for p in prepared]).to(device)
        sizes = [p.resized_hw for p in prepared]
        scaled = [scale_target(t, p, device) for t, p in zip(targets, prepared)]
        feats = self.backbone(canvas)
        proposals, rpn_losses = self.rpn(ImageList(canvas, sizes), feats, scaled)
        proposals, matched, labels, reg_targets = self.roi_heads.select_training_samples(proposals, scaled)
        features = self._box_head(feats, proposals, sizes)
        class_logits, box_regression = self.roi_heads.box_predictor(features)
        loss_cls, loss_box = fastrcnn_loss(class_logits, box_regression, labels, reg_targets)
        attr_logits = self.attr_score(features)
        fg = torch.cat(labels) > 0
        attr_targets = torch.cat([t["attributes"][m] for t, m in zip(scaled, matched)])  # (R, A)
        if fg.any() and self.config.attributes:
            loss_attr = F.binary_cross_entropy_with_logits(attr_logits[fg], attr_targets[fg])
        else:
            loss_attr = attr_logits.sum() * 0.0
        return {**rpn_losses, "loss_classifier": loss_cls, "loss_box_reg": loss_box, "loss_attributes": loss_attr}


def pad_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stack (3, H, W) canvases, zero-padding to the largest (training only: features need not match alone)."""
    h = max(t.shape[1] for t in tensors)
    w = max(t.shape[2] for t in tensors)
    return torch.stack([F.pad(t, (0, w - t.shape[2], 0, h - t.shape[1])) for t in tensors])


def scale_target(target: dict[str, torch.Tensor], prep: Prepared, device) -> dict[str, torch.Tensor]:
    """Boxes to resized-image pixels, labels to 1-based (0 = background), attributes as float."""
    return {
        "boxes": (target["boxes"].float() * prep.scale).to(device),
        "labels": (target["labels"].long() + 1).to(device),
        "attributes": target["attributes"].float().to(device),
    }


def box_recall(pred: torch.Tensor, gold: torch.Tensor, thresh: float = 0.5) -> float:
    """Fraction of gold boxes matched by some predicted box with IoU >= thresh."""
    if gold.numel() == 0:
        return 1.0
    if pred.numel() == 0:
        return 0.0
    return float((box_iou(gold, pred).max(dim=1).values >= thresh).float().mean())
