"""The padded batch every encoder and head reads."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class VLInputs:
    input_ids: torch.Tensor  # (B, T) WordPiece ids; (B, C, T) for multiple choice
    attention_mask: torch.Tensor  # (B, T) 1 = real token
    token_type_ids: torch.Tensor  # (B, T) segment ids
    region_features: torch.Tensor  # (B, N, D); (B, 2, N, D) for NLVR2 image pairs
    region_boxes: torch.Tensor  # (B, N, 4) normalized x1, y1, x2, y2 in [0, 1]
    region_mask: torch.Tensor  # (B, N) 1 = real region (num_boxes), 0 = padding
    image_feature: torch.Tensor | None = None  # (B, D) whole-image feature (VL-BERT, ViLBERT [IMG])
    tag_ids: torch.Tensor | None = None  # (B, N) word ids of detector tags, -1 = none (U-VisualBERT)
    phrase_index: torch.Tensor | None = None  # (B, P) token index of each phrase's last sub-word, -1 = none

    def encoder_kwargs(self) -> dict[str, torch.Tensor | None]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "phrase_index"
        }

    def replace(self, **changes) -> VLInputs:
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> VLInputs:
        return VLInputs(**{
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(self)
        })


def _tensors_traced() -> bool:
    """Whether the forward is being traced or compiled (export): checks of values would be baked into the graph."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export()


def check_inputs(inputs: VLInputs, *, vocab_size: int, type_vocab_size: int, feature_dim: int, text_positions: int,
                 weight_dtype: torch.dtype, choices: bool = False, pairs: bool = False) -> None:
    """A clear ValueError/TypeError naming the field for a batch the encoder would misread or fail on deep inside:
    shapes that disagree (a batch of 1 would broadcast against 2 into plausible logits), the wrong feature width,
    dtypes,
    a text longer than the position table, a row without a real token, ids outside the tables, NaN, boxes that are
    not x1, y1, x2, y2 in [0, 1]. (A row without a real region is valid: an image the detector found nothing in.)
    `choices`: input_ids (B, C, T) (multiple choice); `pairs`: regions (B, 2, N, ...) (NLVR2). Values are checked on
    CPU tensors only (on a GPU each check would synchronise the device) and never while the forward is traced for
    export."""
    if _tensors_traced():
        return
    for f in dataclasses.fields(inputs):
        value = getattr(inputs, f.name)
        if value is None and f.default is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"VLInputs.{f.name} must be a torch.Tensor, not {type(value).__name__}")
    text_dims, region_dims = (3 if choices else 2), (4 if pairs else 3)
    ids = inputs.input_ids
    if ids.dim() != text_dims:
        shape = "(B, C, T)" if choices else "(B, T)"
        raise ValueError(f"VLInputs.input_ids must be {shape} for this head, not {tuple(ids.shape)}")
    feats = inputs.region_features
    if feats.dim() != region_dims:
        shape = "(B, 2, N, D)" if pairs else "(B, N, D)"
        raise ValueError(f"VLInputs.region_features must be {shape} for this head, not {tuple(feats.shape)}")
    for name in ("attention_mask", "token_type_ids"):
        if getattr(inputs, name).shape != ids.shape:
            raise ValueError(f"VLInputs.{name} {tuple(getattr(inputs, name).shape)} must have input_ids' shape {tuple(ids.shape)}")
    regions = feats.shape[:-1]
    tags = inputs.tag_ids  # (..., N) one tag word a region, or (..., N, K) each tag's sub-words
    expected = {"region_boxes": (*regions, 4), "region_mask": regions,
                "tag_ids": (*regions, tags.shape[-1]) if tags is not None and tags.dim() == feats.dim() else regions,
                "image_feature": (*regions[:-1], feats.shape[-1])}
    for name, shape in expected.items():
        value = getattr(inputs, name)
        if value is not None and tuple(value.shape) != tuple(shape):
            raise ValueError(f"VLInputs.{name} {tuple(value.shape)} must be {tuple(shape)} to go with region_features "
                             f"{tuple(feats.shape)}")
    if feats.shape[0] != ids.shape[0]:
        raise ValueError(f"VLInputs: the text's batch ({ids.shape[0]}) and the regions' ({feats.shape[0]}) differ")
    if feats.shape[-1] != feature_dim:
        raise ValueError(f"VLInputs.region_features are {feats.shape[-1]}-d; this model reads {feature_dim}-d features")
    if regions[-1] == 0:
        raise ValueError("VLInputs: no regions (N = 0); give an image without regions one padding region of mask 0")
    if ids.shape[-1] > text_positions:
        raise ValueError(f"VLInputs.input_ids: {ids.shape[-1]} tokens, more than the model's {text_positions} text positions")
    for name in ("input_ids", "attention_mask", "token_type_ids", "region_mask", "tag_ids", "phrase_index"):
        value = getattr(inputs, name)
        if value is not None and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
            raise TypeError(f"VLInputs.{name} must be an integer tensor, not {value.dtype}")
    for name in ("region_features", "region_boxes", "image_feature"):
        value = getattr(inputs, name)
        if value is not None and not value.is_floating_point():
            raise TypeError(f"VLInputs.{name} must be a floating-point tensor, not {value.dtype}")
        if value is not None and value.dtype == torch.float64 and weight_dtype != torch.float64:
            raise TypeError(f"VLInputs.{name} is float64; this model's weights are {weight_dtype}")
    if ids.device.type != "cpu":
        return
    _check_values(inputs, vocab_size, type_vocab_size)


def _check_values(inputs: VLInputs, vocab_size: int, type_vocab_size: int) -> None:
    def within(name: str, value: torch.Tensor, low: int, high: int) -> None:
        if value.numel() and (int(value.min()) < low or int(value.max()) >= high):
            raise ValueError(f"VLInputs.{name} must lie in [{low}, {high - 1}]; it has {int(value.min())}..{int(value.max())}")

    within("input_ids", inputs.input_ids, 0, vocab_size)
    within("token_type_ids", inputs.token_type_ids, 0, type_vocab_size)
    for name in ("attention_mask", "region_mask"):
        within(name, getattr(inputs, name), 0, 2)
    if (inputs.attention_mask.sum(-1) == 0).any():
        raise ValueError("VLInputs.attention_mask: a row without a real token (every text needs at least [CLS])")
    if inputs.tag_ids is not None:
        within("tag_ids", inputs.tag_ids, -1, vocab_size)
    for name in ("region_features", "region_boxes", "image_feature"):
        value = getattr(inputs, name)
        # one sum first (a NaN or infinity carries into it); the exact test only where it is not finite
        if value is not None and not bool(torch.isfinite(value.sum())) and not bool(torch.isfinite(value).all()):
            raise ValueError(f"VLInputs.{name} has NaN or infinite values")
    boxes = inputs.region_boxes[inputs.region_mask.bool()]  # a padding region's box is never read
    if boxes.numel() and (float(boxes.min()) < -BOX_SLACK or float(boxes.max()) > 1 + BOX_SLACK
                          or bool((boxes[..., 2:] < boxes[..., :2] - BOX_SLACK).any())):
        raise ValueError("VLInputs.region_boxes of real regions must be x1, y1, x2, y2 in [0, 1] (divided by the "
                         "image's width and height) with x1 <= x2 and y1 <= y2")


BOX_SLACK = 1e-4  # float rounding of a box divided by the image's size
