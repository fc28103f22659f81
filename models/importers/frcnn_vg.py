"""`vlserve import frcnn-vg SRC OUT`: the bottom-up-attention detector of the public LXMERT/VisualBERT checkpoints.

SRC is a directory in the format of the hub's unc-nlp/frcnn-vg-finetuned, the ResNet-101 C4 Faster R-CNN of Visual
Genome ported to PyTorch for transformers' LXMERT/VisualBERT demos (examples/research_projects/lxmert, now in
huggingface/transformers-research-projects: modeling_frcnn.py, processing_image.py, utils.py):
  config.yaml                          that code's config (sections at the top level: MODEL, INPUT, RESNETS, RPN, ...)
  model.safetensors | pytorch_model.bin  GeneralizedRCNN.state_dict(); a pickle is read with weights_only (plain
                                       tensors only, never arbitrary objects)
The class and attribute names come from Visual Genome's objects_vocab.txt and attributes_vocab.txt (a name per line,
synonyms after commas). OUT is a vlserve detector directory (models/detector/io.py) of family "butd".

Every config key is mapped to a DetectorConfig field, checked against the one value the reference supports, or
known to leave inference alone (training settings, detectron2 settings the reference never reads); any other key
fails naming it. Every tensor maps by the renames below; the BatchNorm counters (`num_batches_tracked`) are the
only tensors deliberately unused (eval-mode batch norm never reads them). A missing, extra or mis-shaped tensor
fails naming it.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import yaml

from ..checkpoint import CheckpointError, load_state_strict
from ..detector import DetectorConfig, RegionDetector
from ..detector.io import save_detector
from .hf_common import checked_values, load_weight_file

FORMAT = "frcnn-vg"
CONFIG_FILE = "config.yaml"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # preferred first
UNUSED_TENSOR = ".num_batches_tracked"  # BatchNorm's training counter

# our key -> source key: each rename applied in turn (torchvision Bottleneck names -> the reference's Conv2d + norm)
RENAMES = (
    (r"\.bn([123])\.", r".conv\1.norm."),  # batch norms sit inside the reference's convs
    (r"\.downsample\.0\.", ".shortcut."),
    (r"\.downsample\.1\.", ".shortcut.norm."),
    (r"^rpn\.cell_anchors$", "proposal_generator.anchor_generator.cell_anchors.0"),
    (r"^rpn\.conv\.", "proposal_generator.rpn_head.conv."),
    (r"^rpn\.objectness\.", "proposal_generator.rpn_head.objectness_logits."),
    (r"^rpn\.deltas\.", "proposal_generator.rpn_head.anchor_deltas."),
    (r"^roi_heads\.(cls_score|bbox_pred|cls_embedding|fc_attr|attr_score)\.", r"roi_heads.box_predictor.\1."),
)

# config.yaml key -> (DetectorConfig field, expected type); every key the reference reads that shapes inference
FIELDS = {
    "MODEL.PIXEL_MEAN": ("mean", "triple"),
    "MODEL.PIXEL_STD": ("std", "triple"),
    "MODEL.MAX_POOL": ("resnet_caffe_maxpool", bool),
    "INPUT.FORMAT": ("channel_order", str),
    "INPUT.MIN_SIZE_TEST": ("min_size", int),
    "INPUT.MAX_SIZE_TEST": ("max_size", int),
    "MIN_DETECTIONS": ("min_boxes", int),
    "MAX_DETECTIONS": ("num_boxes", int),
    "RESNETS.DEPTH": ("resnet_depth", int),
    "RESNETS.STEM_OUT_CHANNELS": ("resnet_stem_channels", int),
    "RESNETS.RES2_OUT_CHANNELS": ("resnet_res2_channels", int),
    "RESNETS.NUM_GROUPS": ("resnet_groups", int),
    "RESNETS.STRIDE_IN_1X1": ("resnet_stride_in_1x1", bool),
    "PROPOSAL_GENERATOR.HIDDEN_CHANNELS": ("rpn_channels", int),
    "PROPOSAL_GENERATOR.MIN_SIZE": ("rpn_min_size", float),
    "ANCHOR_GENERATOR.OFFSET": ("anchor_offset", float),
    "RPN.NMS_THRESH": ("rpn_nms_thresh", float),
    "RPN.PRE_NMS_TOPK_TEST": ("rpn_pre_nms_top_n", int),
    "RPN.POST_NMS_TOPK_TEST": ("rpn_post_nms_top_n", int),
    "RPN.BBOX_REG_WEIGHTS": ("rpn_box_weights", "quad"),
    "ROI_HEADS.SCORE_THRESH_TEST": ("det_score_thresh", float),  # the reference's selection never reads it
    "ROI_BOX_HEAD.POOLER_RESOLUTION": ("roi_size", int),
    "ROI_BOX_HEAD.BBOX_REG_WEIGHTS": ("box_weights", "quad"),
}
# read and turned into fields by hand in detector_config
DERIVED = ("RESNETS.WIDTH_PER_GROUP", "ANCHOR_GENERATOR.SIZES", "ANCHOR_GENERATOR.ASPECT_RATIOS",
           "ROI_HEADS.NMS_THRESH_TEST", "ROI_HEADS.NUM_CLASSES", "ROI_BOX_HEAD.NUM_ATTRS", "ROI_BOX_HEAD.RES5HALVE")
# DetectorConfig field -> the config.yaml key it comes from, named when DetectorConfig refuses the field's value
SOURCE_KEYS = {field: key for key, (field, _) in FIELDS.items()} | {
    "resnet_bottleneck_channels": "RESNETS.WIDTH_PER_GROUP", "anchor_sizes": "ANCHOR_GENERATOR.SIZES",
    "aspect_ratios": "ANCHOR_GENERATOR.ASPECT_RATIOS", "region_nms_thresh": "ROI_HEADS.NMS_THRESH_TEST"}
# keys whose only value the reference runs with (any other crashes it or is not implemented there)
SUPPORTED = {
    "SIZE_DIVISIBILITY": 0,
    "RESNETS.NORM": "BN",
    "RESNETS.OUT_FEATURES": ["res4"],
    "RPN.IN_FEATURES": ["res4"],
    "ROI_HEADS.IN_FEATURES": ["res4"],
    "ROI_BOX_HEAD.ATTR": True,
    "ROI_BOX_HEAD.CLS_AGNOSTIC_BBOX_REG": False,
}
# read by the reference without changing a single-image result
NO_EFFECT = {
    "MODEL.DEVICE": "vlserve chooses the device when it loads the detector",
    "PAD_VALUE": "the reference pads batches to their largest image; vlserve batches equal sizes only",
    "RESNETS.RES5_DILATION": "applies to a backbone res5, which a C4 detector does not build",
    "BACKBONE.FREEZE_AT": "training",
    "ROI_BOX_HEAD.POOLER_SAMPLING_RATIO": "RoIPool has no sampling ratio",
    "ROI_BOX_HEAD.SMOOTH_L1_BETA": "training",
    **{f"RPN.{k}": "training" for k in ("BATCH_SIZE_PER_IMAGE", "POSITIVE_FRACTION", "SMOOTH_L1_BETA", "LOSS_WEIGHT",
                                       "BOUNDARY_THRESH", "IOU_THRESHOLDS", "IOU_LABELS", "PRE_NMS_TOPK_TRAIN",
                                       "POST_NMS_TOPK_TRAIN")},
    **{f"ROI_HEADS.{k}": "training" for k in ("IOU_THRESHOLDS", "IOU_LABELS", "POSITIVE_FRACTION",
                                             "PROPOSAL_APPEND_GT", "BATCH_SIZE_PER_IMAGE")},
}
# detectron2 settings the reference never reads: keys of the sections it reads, and whole sections
NEVER_READ = {
    "MODEL": ("LOAD_PROPOSALS", "MASK_ON", "KEYPOINT_ON", "META_ARCHITECTURE", "WEIGHTS", "CAFFE_MAXPOOL"),
    "INPUT": ("MIN_SIZE_TRAIN", "MIN_SIZE_TRAIN_SAMPLING", "MAX_SIZE_TRAIN", "CROP", "MASK_FORMAT"),
    "BACKBONE": ("NAME",),
    "PROPOSAL_GENERATOR": ("NAME", "HID_CHANNELS"),
    "ANCHOR_GENERATOR": ("NAME", "ANGLES"),
    "RPN": ("HEAD_NAME",),
    "ROI_HEADS": ("NAME",),
    "ROI_BOX_HEAD": ("NAME", "POOLER_TYPE", "NUM_FC", "FC_DIM", "NUM_CONV", "CONV_DIM", "NORM"),
    "RESNETS": ("DEFORM_ON_PER_STAGE", "DEFORM_MODULATED", "DEFORM_NUM_GROUPS"),
}
NEVER_READ_SECTIONS = ("DATASETS", "DATALOADER", "SOLVER", "TEST", "FPN", "ROI_BOX_CASCADE_HEAD", "ROI_MASK_HEAD",
                       "ROI_KEYPOINT_HEAD", "SEM_SEG_HEAD", "PANOPTIC_FPN", "RETINANET", "GLOBAL", "VERSION",
                       "OUTPUT_DIR", "SEED", "CUDNN_BENCHMARK", "VIS_PERIOD")
# bottom-up attention's adaptive mode (generate_tsv.py): per-class NMS 0.3, regions of confidence >= 0.2, 10 to 100
ADAPTIVE = dict(adaptive=True, selection="per-class-nms", region_nms_thresh=0.3, conf_thresh=0.2, min_boxes=10,
                max_boxes=100)


class FrcnnImportError(CheckpointError):
    """An frcnn-vg directory (or vocabulary) that cannot be imported; the message names the file, key or tensor."""


def source_key(ours: str) -> str:
    for pattern, repl in RENAMES:
        ours = re.sub(pattern, repl, ours)
    return ours


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= _flatten(value, f"{name}.")
        else:
            flat[name] = value
    return flat


def _known(key: str) -> bool:
    section, _, rest = key.partition(".")
    if key in FIELDS or key in DERIVED or key in SUPPORTED or key in NO_EFFECT or section in NEVER_READ_SECTIONS:
        return True
    return rest.split(".")[0] in NEVER_READ.get(section, ())


def read_config(path: Path) -> dict[str, Any]:
    """config.yaml as flat `SECTION.KEY` -> value; an unreadable file or an unknown key fails naming it."""
    if not path.is_file():
        raise FrcnnImportError(f"{path.parent}: missing file {path.name}")
    try:
        tree = yaml.safe_load(path.read_text())
    except RecursionError:
        raise FrcnnImportError(f"{path}: not valid YAML (nested too deeply)") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise FrcnnImportError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise FrcnnImportError(f"{path}: expected a mapping of sections")
    flat = _flatten(tree)
    unknown = sorted(k for k in flat if not _known(k))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise FrcnnImportError(f"{path}: unknown key {unknown[0]}{more}; frcnn-vg's config.yaml has no such setting")
    return flat


class _Config:
    """Typed reads of the flat config, failing with the file and the key."""

    def __init__(self, path: Path, flat: dict[str, Any]):
        self.path, self.flat = path, flat

    def get(self, key: str, kind: Any) -> Any:
        if key not in self.flat:
            raise FrcnnImportError(f"{self.path}: key {key} is missing")
        value = self.flat[key]
        ok = {
            int: isinstance(value, int) and not isinstance(value, bool),
            float: isinstance(value, (int, float)) and not isinstance(value, bool),
            bool: isinstance(value, bool),
            str: isinstance(value, str),
            list: isinstance(value, list),
            "triple": _numbers(value, 3),
            "quad": _numbers(value, 4),
            "threshold": _numbers(value if isinstance(value, list) else [value], 1),
        }[kind]
        if not ok:
            expected = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
                        "triple": "3 numbers", "quad": "4 numbers",
                        "threshold": "one number (a list of fallback thresholds is not supported)"}[kind]
            raise FrcnnImportError(f"{self.path}: {key} is {value!r}, expected {expected}")
        if kind in ("triple", "quad"):
            return tuple(float(v) for v in value)
        if kind == "threshold":
            return float(value[0] if isinstance(value, list) else value)
        return float(value) if kind is float else value

    def one_level(self, key: str) -> list:
        """ANCHOR_GENERATOR lists: one list for the one feature level (res4) of a C4 detector."""
        value = self.get(key, list)
        inner = value[0] if len(value) == 1 and isinstance(value[0], list) else None
        if inner is None or not inner or not _numbers(inner, len(inner)):
            raise FrcnnImportError(f"{self.path}: {key} is {value!r}, expected one list of numbers (one feature level)")
        return inner


def _numbers(value: Any, count: int) -> bool:
    return (isinstance(value, list) and len(value) == count
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))


def read_vocabulary(path: Path, count: int, what: str, key: str) -> list[str]:
    """Names of a Visual Genome vocab file (the first name of each line, lower case, as the reference reads them)."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a byte-order mark is no class name
    except (OSError, UnicodeDecodeError) as exc:
        raise FrcnnImportError(f"{path}: unreadable {what} vocabulary ({exc})") from None
    while lines and not lines[-1].strip():
        lines.pop()
    names = [line.split(",")[0].strip().lower() for line in lines]
    if "" in names:
        raise FrcnnImportError(f"{path}: line {names.index('') + 1} has no {what} name")
    if len(names) != count:
        raise FrcnnImportError(f"{path}: {len(names)} {what} names, but the checkpoint has {count} "
                               f"({CONFIG_FILE} {key})")
    return names


def detector_config(cfg: _Config, objects: Path, attributes: Path,
                    adaptive: bool) -> tuple[DetectorConfig, list[str]]:
    """The DetectorConfig a config.yaml describes, and the config keys that leave inference alone."""
    for key, value in SUPPORTED.items():
        if cfg.get(key, type(value)) != value:
            raise FrcnnImportError(f"{cfg.path}: {key} is {cfg.flat[key]!r}; the frcnn-vg detector runs with "
                                   f"{value!r} only")
    if cfg.get("RESNETS.RES5_DILATION", int) not in (1, 2):
        raise FrcnnImportError(f"{cfg.path}: RESNETS.RES5_DILATION must be 1 or 2")
    if cfg.get("INPUT.MIN_SIZE_TEST", int) <= 0:
        raise FrcnnImportError(f"{cfg.path}: INPUT.MIN_SIZE_TEST must be positive (the reference always resizes)")
    nms = cfg.get("ROI_HEADS.NMS_THRESH_TEST", "threshold")  # the reference also takes a list, tried in turn
    fields = {field: cfg.get(key, kind) for key, (field, kind) in FIELDS.items()}
    if fields["channel_order"] not in ("RGB", "BGR"):
        raise FrcnnImportError(f"{cfg.path}: INPUT.FORMAT is {fields['channel_order']!r}, expected BGR or RGB")
    res2 = fields["resnet_res2_channels"]
    classes = read_vocabulary(objects, cfg.get("ROI_HEADS.NUM_CLASSES", int), "object", "ROI_HEADS.NUM_CLASSES")
    attrs = read_vocabulary(attributes, cfg.get("ROI_BOX_HEAD.NUM_ATTRS", int), "attribute", "ROI_BOX_HEAD.NUM_ATTRS")
    fields |= dict(
        family="butd", backbone=f"resnet{fields['resnet_depth']}-c4", classes=classes, attributes=attrs,
        resnet_bottleneck_channels=fields["resnet_groups"] * cfg.get("RESNETS.WIDTH_PER_GROUP", int),
        feature_dim=8 * res2, anchor_sizes=(tuple(cfg.one_level("ANCHOR_GENERATOR.SIZES")),),
        aspect_ratios=tuple(cfg.one_level("ANCHOR_GENERATOR.ASPECT_RATIOS")),
        res5_dilated=not cfg.get("ROI_BOX_HEAD.RES5HALVE", bool), region_nms_thresh=nms,
        pixel_range=255.0, resize="detectron2", size_divisible=1, selection="argmax-nms", image_feature=False,
    )
    if adaptive:
        fields |= ADAPTIVE
    try:
        config = DetectorConfig(**fields)
    except ValueError as exc:  # its message starts with the field at fault
        key = SOURCE_KEYS.get(str(exc).split()[0])
        raise FrcnnImportError(f"{cfg.path}: {f'{key}: ' if key else ''}{exc}") from None
    return config, sorted(k for k in cfg.flat if k not in FIELDS and k not in DERIVED and k not in SUPPORTED)


def map_weights(model: RegionDetector, state: dict[str, torch.Tensor],
                path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our state dict from the source's (`model` may be built on the meta device: only its tensors' shapes and
    types are read), and the source tensors deliberately unused. A missing, mis-shaped or extra source tensor, or one
    not floating point or not finite, fails naming it."""
    weights, used = {}, set()
    for ours, want in model.state_dict().items():
        src = source_key(ours)
        if src not in state:
            raise FrcnnImportError(f"{path}: tensor {src} is missing (the config needs it for {ours})")
        if tuple(state[src].shape) != tuple(want.shape):
            raise FrcnnImportError(f"{path}: tensor {src} has shape {tuple(state[src].shape)}, the config needs "
                                   f"{tuple(want.shape)}")
        try:
            weights[ours] = checked_values(path, src, state[src]).to(want.dtype)
        except CheckpointError as exc:
            raise FrcnnImportError(str(exc)) from None
        used.add(src)
    unused = sorted(k for k in state if k.endswith(UNUSED_TENSOR) and
                    k.removesuffix(UNUSED_TENSOR) + ".running_mean" in used)
    extra = sorted(set(state) - used - set(unused))
    if extra:
        more = f" ({len(extra)} unexpected)" if len(extra) > 1 else ""
        raise FrcnnImportError(f"{path}: unexpected tensor {extra[0]}{more}; it is not part of the detector "
                               f"{CONFIG_FILE} describes")
    return weights, unused


def import_frcnn_vg(src: str | Path, out: str | Path, objects: str | Path, attributes: str | Path,
                    adaptive: bool = False) -> Path:
    """Convert an frcnn-vg directory into a vlserve detector directory; returns OUT."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise FrcnnImportError(f"{src}: not a directory (expected {CONFIG_FILE} and {' or '.join(WEIGHT_FILES)})")
    cfg = _Config(src / CONFIG_FILE, read_config(src / CONFIG_FILE))
    config, unused_keys = detector_config(cfg, Path(objects), Path(attributes), adaptive)
    weights_file = next((name for name in WEIGHT_FILES if (src / name).is_file()), None)
    if weights_file is None:
        raise FrcnnImportError(f"{src}: no weights file (looked for {', '.join(WEIGHT_FILES)})")
    try:
        state = load_weight_file(src / weights_file)
    except CheckpointError as exc:
        raise FrcnnImportError(str(exc)) from None
    with torch.device("meta"):  # the shapes the config gives, checked before any memory is taken
        shapes = RegionDetector(config)
    weights, unused = map_weights(shapes, state, src / weights_file)
    model = RegionDetector(config).eval()
    load_state_strict(model, weights, src / weights_file)
    record = {
        "format": FORMAT,
        "source": str(src.resolve()),
        "weights_file": weights_file,
        "objects": str(Path(objects).resolve()),
        "attributes": str(Path(attributes).resolve()),
        "ignored_keys": unused,  # BatchNorm counters; eval-mode batch norm never reads them
        "ignored_config_keys": unused_keys,
    }
    save_detector(model, out, extra={"import": record})
    return out
