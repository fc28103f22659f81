"""The fused transformer with one task head as an ONNX graph: dynamic batch, text length and region count.

One graph per task. Inputs are the VLInputs fields the preset and head read (names = runtime batch keys):
input_ids / attention_mask / token_type_ids (B, T) ((B, C, T) multiple choice), region_features (B, N, D),
region_boxes (B, N, 4), region_mask (B, N) (NLVR2: (B, 2, N, ...)), image_feature (B, D) for the presets that
read a whole-image feature (VL-BERT, ViLBERT), tag_ids (B, N) for U-VisualBERT, phrase_index (B, P) for
grounding. Output: logits, as VLModel(inputs, task).logits.

Exporter: the TorchScript exporter (`dynamo=False`, dynamic_axes). torch 2.14's default dynamo exporter
was tried first: it is 10-30x slower (ViLBERT-tiny 12 s a graph), cannot emit the fused attention operators
of --optimize (export/fused.py), and its multiple-choice graphs failed at run time for any batch > 1 until
the head stopped using repeat_interleave by the symbolic choice count. The TorchScript graphs match torch
to ~1e-7 at every size tried. `exporter="dynamo"` keeps the other path (same inputs, dynamic_shapes); every
graph, however exported, must pass the parity check (export/parity.py).
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from models import ModelConfig, VLInputs, VLModel
from models.repository import DEFAULT_OPSET, GraphSpec, InputSpec, graph_feed

EXPORTED_KINDS = ("vqa", "image_qa", "nlvr2", "refer", "itm", "multiple_choice", "grounding")  # task heads
IMAGE_FEATURE_PRESETS = ("vl-bert", "vilbert")  # presets whose encoder reads image_feature
EXPORTERS = ("torchscript", "dynamo")
# the TorchScript exporter writes every preset's attention (scaled_dot_product_attention) from opset 14 on
MIN_OPSET = 14
# torch's dynamo exporter builds opset-18 graphs; asked for less, it down-converts them and leaves opset-18
# operators in (Split with num_outputs), which onnxruntime rejects
DYNAMO_MIN_OPSET = 18
INT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "region_mask", "tag_ids", "phrase_index")
MAX_TEXT = 512  # upper bound of the symbolic text length given to the dynamo exporter
# loggers of the dynamo exporter's libraries: their passes log every step, and conversions they fall back from with
# tracebacks, at INFO and WARNING (about 1,500 lines for a graph onnxruntime then refuses)
EXPORTER_LOGGERS = ("onnxscript", "onnx_ir", "torch.onnx", "torch.export", "torch._export", "torch._dynamo", "torch.fx")


def exportable_tasks(config: ModelConfig) -> dict[str, str]:
    """task -> head kind of the heads that get a graph (pretraining heads do not)."""
    return {task: h.kind for task, h in config.heads.items() if h.kind in EXPORTED_KINDS}


def graph_spec(config: ModelConfig, task: str) -> GraphSpec:
    """Input and output names, dtypes and symbolic shapes of `task`'s graph."""
    head = config.heads[task]
    enc = config.encoder
    kind = head.kind
    if kind not in EXPORTED_KINDS:
        raise ValueError(f"head {task!r} ({kind}) is not exported; exported kinds: {', '.join(EXPORTED_KINDS)}")
    text = ("batch", "choices", "text") if kind == "multiple_choice" else ("batch", "text")
    lead = ("batch", 2) if kind == "nlvr2" else ("batch",)  # NLVR2: one region set per image of the pair
    regions = (*lead, "regions")
    inputs = [
        InputSpec("input_ids", "int64", text), InputSpec("attention_mask", "int64", text),
        InputSpec("token_type_ids", "int64", text),
        InputSpec("region_features", "float32", (*regions, enc.visual_feat_dim)),
        InputSpec("region_boxes", "float32", (*regions, 4)), InputSpec("region_mask", "int64", regions),
    ]
    joint = kind == "nlvr2" and head.nlvr2_mode == "joint"  # joint NLVR2 drops the whole-image feature
    if enc.preset in IMAGE_FEATURE_PRESETS and not joint:
        inputs.append(InputSpec("image_feature", "float32", (*lead, enc.visual_feat_dim)))
    # the published embeddings read every sub-word of a region's tag, (..., N, K), each a token of its own: a model
    # trained without region tags (the service then sends none) is exported without them, not with N*K masked tokens
    published = enc.embedding_style == "published"
    if enc.preset == "u-visualbert" and (enc.region_tags or not published):
        inputs.append(InputSpec("tag_ids", "int64", (*regions, "subwords") if published else regions))
    if kind == "grounding":
        inputs.append(InputSpec("phrase_index", "int64", ("batch", "phrases")))
    out = {
        "vqa": ("batch", head.num_labels), "image_qa": ("batch", head.num_labels), "nlvr2": ("batch", 2),
        "itm": ("batch", 2), "refer": ("batch", "regions"), "multiple_choice": ("batch", "choices"),
        "grounding": ("batch", "phrases", "regions"),
    }[kind]
    if joint:
        out = ("batch", 2)
    return GraphSpec(task, kind, tuple(inputs), (InputSpec("logits", "float32", out),))


class TaskGraph(nn.Module):
    """VLModel(inputs, task).logits with the inputs as positional tensors, in GraphSpec order."""

    def __init__(self, model: VLModel, spec: GraphSpec):
        super().__init__()
        self.model = model
        self.spec = spec

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        inputs = VLInputs(**dict(zip(self.spec.input_names, tensors)))
        return self.model(inputs, self.spec.task).logits


def to_torch(feed: dict[str, np.ndarray]) -> VLInputs:
    return VLInputs(**{k: torch.from_numpy(v) for k, v in feed.items()})


def synthetic_batch(
    config: ModelConfig, task: str, batch: int, text_len: int, regions: int, seed: int = 0, choices: int = 3,
    phrases: int = 2,
) -> dict[str, np.ndarray]:
    """A right-padded batch shaped like the service's: [CLS] words ([MASK]) [SEP] + pad, detector-like regions.

    Row lengths vary (some rows padded), features are non-negative (post-ReLU, as the detector's box head),
    boxes are valid normalized x1 < x2, y1 < y2; padding is zeros, as the service's collate pads.
    """
    spec = graph_spec(config, task)
    head, enc = config.heads[task], config.encoder
    if text_len > enc.text_positions:  # a longer row would index past the position table
        raise ValueError(f"a text of {text_len} tokens is longer than the {enc.text_positions} positions this "
                         f"{enc.preset} encoder places")
    rng = np.random.default_rng(seed)
    text_shape = (batch, choices) if spec.kind == "multiple_choice" else (batch,)
    region_shape = (batch, 2) if spec.kind == "nlvr2" else (batch,)

    lengths = rng.integers(min(4, text_len), text_len + 1, size=text_shape)
    lengths.reshape(-1)[0] = text_len  # the longest row sets the width, as when the service pads
    mask = (np.arange(text_len) < lengths[..., None]).astype(np.int64)
    words = (1000 if enc.vocab_size > 1000 else enc.mask_token_id + 1, min(enc.vocab_size, 30000))  # past the specials
    ids = rng.integers(*words, size=(*text_shape, text_len))
    ids[..., 0] = enc.cls_token_id
    np.put_along_axis(ids, lengths[..., None] - 1, enc.sep_token_id, -1)
    if head.pool in ("answer_slot", "answer_segment"):
        np.put_along_axis(ids, lengths[..., None] - 2, enc.mask_token_id, -1)
    ids = np.where(mask == 1, ids, enc.pad_token_id)
    types = np.zeros_like(ids)
    if spec.kind == "multiple_choice":  # [CLS] question [SEP] answer [SEP]: the second half is segment B
        types = ((np.arange(text_len) >= lengths[..., None] // 2) & (mask == 1)).astype(np.int64)

    counts = rng.integers(1, regions + 1, size=region_shape)
    counts.reshape(-1)[0] = regions
    rmask = (np.arange(regions) < counts[..., None]).astype(np.int64)
    feats = np.abs(rng.standard_normal((*region_shape, regions, enc.visual_feat_dim))).astype(np.float32)
    lo = rng.uniform(0.0, 0.6, (*region_shape, regions, 2))
    size = rng.uniform(0.05, 0.4, (*region_shape, regions, 2))
    boxes = np.concatenate([lo, np.minimum(lo + size, 1.0)], -1).astype(np.float32)
    out = {
        "input_ids": ids, "attention_mask": mask, "token_type_ids": types,
        "region_features": feats * rmask[..., None], "region_boxes": boxes * rmask[..., None], "region_mask": rmask,
    }
    names = set(spec.input_names)
    if "image_feature" in names:
        out["image_feature"] = np.abs(rng.standard_normal((*region_shape, enc.visual_feat_dim))).astype(np.float32)
    if "tag_ids" in names:
        subwords = (3,) if enc.embedding_style == "published" else ()  # sub-words of each region's tag
        tags = rng.integers(*words, size=(*region_shape, regions, *subwords))
        tags[rng.random(tags.shape) < 0.3] = -1  # regions (sub-word slots) without a detector tag
        out["tag_ids"] = np.where((rmask == 1).reshape(rmask.shape + (1,) * len(subwords)), tags, -1)
    if "phrase_index" in names:
        idx = 1 + (rng.random((batch, phrases)) * (lengths[:, None] - 2)).astype(np.int64)
        idx[rng.random(idx.shape) < 0.2] = -1
        out["phrase_index"] = idx
    return graph_feed(spec, out)


def _dynamic_axes(spec: GraphSpec) -> dict[str, dict[int, str]]:
    return {t.name: {i: d for i, d in enumerate(t.shape) if isinstance(d, str)} for t in (*spec.inputs, *spec.outputs)}


def _dynamic_shapes(spec: GraphSpec) -> tuple[tuple[dict[int, object], ...]]:
    """One Dim per axis name, shared by every input that has it; nested once for TaskGraph's *tensors."""
    dims: dict[str, object] = {}
    for name in {d for t in spec.inputs for d in t.shape if isinstance(d, str)}:
        dims[name] = torch.export.Dim(name, min=1, max=MAX_TEXT if name == "text" else 4096)
    return (tuple({i: dims[d] for i, d in enumerate(t.shape) if isinstance(d, str)} for t in spec.inputs),)


@contextmanager
def quiet_exporter() -> Iterator[None]:
    """The exporters' own logs below ERROR off while a graph is exported, their levels restored after: what fails
    says so in the exception, which the export reports as one line; parity tells a good graph."""
    loggers = [logging.getLogger(name) for name in EXPORTER_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def export_task(
    model: VLModel, task: str, path: str | Path, opset: int = DEFAULT_OPSET, exporter: str = "torchscript",
) -> GraphSpec:
    """Write `task`'s graph (fp32) to `path`; returns its GraphSpec. The model must be in eval mode."""
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}; choose one of {', '.join(EXPORTERS)}")
    spec = graph_spec(model.config, task)
    model = model.float().eval()
    # export sizes: batch 2, 8 tokens, 6 regions, 3 choices -- none of them 1, so no axis is specialised
    example = synthetic_batch(model.config, task, batch=2, text_len=8, regions=6, seed=12345)
    args = tuple(torch.from_numpy(example[n]) for n in spec.input_names)
    graph = TaskGraph(model, spec).eval()
    names = dict(input_names=spec.input_names, output_names=[o.name for o in spec.outputs])
    with warnings.catch_warnings(), quiet_exporter(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer and deprecation warnings: parity is what tells a good graph
        if exporter == "torchscript":
            torch.onnx.export(graph, args, str(path), dynamo=False, opset_version=opset,
                              dynamic_axes=_dynamic_axes(spec), do_constant_folding=True, **names)
        else:  # verbose=False: no "[torch.onnx] ..." progress lines on stdout, where the export's summary goes
            torch.onnx.export(graph, args, str(path), dynamo=True, opset_version=opset, verbose=False,
                              dynamic_shapes=_dynamic_shapes(spec), external_data=False, **names)
    return used_inputs(spec, path)


def used_inputs(spec: GraphSpec, path: str | Path) -> GraphSpec:
    """`spec` less the inputs the exporter dropped because the graph never reads them (VisualBERT's boxes)."""
    import onnx

    kept = {i.name for i in onnx.load(str(path), load_external_data=False).graph.input}
    return replace(spec, inputs=tuple(i for i in spec.inputs if i.name in kept))
