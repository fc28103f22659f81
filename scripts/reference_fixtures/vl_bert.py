"""Fixture for `vlserve import vl-bert`: VL-BERT's own code (github.com/jackroos/VL-BERT) at a tiny config.

    python scripts/reference_fixtures/vl_bert.py REFERENCE [--commit SHA] [--out DIR]

REFERENCE is a checkout (or an archive) of jackroos/VL-BERT; it is read, never copied into vlserve. The script builds
the reference's task models from its own config code and yaml files (cfgs/vqa/base_4x16G_fp32.yaml,
cfgs/refcoco/base_detected_regions_4x16G.yaml, cfgs/pretrain/base_prec_4x16G_fp32.yaml) with tiny sizes, seeded
random weights in every parameter, saves each as its Checkpoint callback saves (`{'state_dict': ...}` of the
DistributedDataParallel model: `module.` keys), and runs each model's own forward on fixed inputs.

Which level runs: the whole task module (ResNetVLBERT of vqa/ and refcoco/, ResNetVLBERTForPretrainingMultitask of
pretrain/), built with NETWORK.IMAGE_FEAT_PRECOMPUTED, the reference's own path for bottom-up-attention features:
its FastRCNN then skips the ResNet and ROIAlign and embeds the given 2048-d region features with the box geometry
(obj_downsample), which is what vlserve does with its detector's features. The e2e checkpoints' ResNet tensors are
listed by the full-size manifest (and imported as deliberately unused). The task modules' inference_forward (VQA,
RefCOCO+) and forward (pretraining) run unchanged; forward hooks on VisualLinguisticBert record what it was given
and its hidden states. Region 0 of every image is the whole image (the datasets' ADD_IMAGE_AS_A_BOX), with box
[0, 0, w, h] and the image's feature; padded boxes are -2 as the datasets pad them.

Files written into DIR (default tests/fixtures/vl_bert):
  vqa.model, refcoco.model, pretrain.model   the three task models' checkpoints
  vqa.yaml, refcoco.yaml, pretrain.yaml      the configs they were built with (the reference's yaml + tiny sizes)
  vocab.txt                                  tiny vocabulary with bert-base-uncased's special ids
  answers_vqa.txt                            the VQA head's answers (the first 7 of data/coco/vqa/answers_vqa.txt
                                             when the reference has it, else made up)
  reference.safetensors                      inputs and the reference's outputs, two input shapes (`a.*`, `b.*`)
  reference.json                             repository, commit, sha256 of every reference file used, the sizes
  manifest_full.json                         key -> shape of every released layout at full (base) size, from the
                                             reference's module tree: pretraining e2e and prec, VQA, RefCOCO+
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
from torch import nn

# scripts/ on the path for reference_fixtures.common (the reference has a `common` package of its own)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_fixtures.common import (  # noqa: E402
    arguments, provenance, randomize, save_tensors, write_record, write_vocab,
)

REPOSITORY = "jackroos/VL-BERT"
USED_FILES = (
    "common/visual_linguistic_bert.py", "common/fast_rcnn.py", "common/utils/bbox.py", "common/module.py",
    "external/pytorch_pretrained_bert/modeling.py", "vqa/modules/resnet_vlbert_for_vqa.py",
    "refcoco/modules/resnet_vlbert_for_refcoco.py", "pretrain/modules/resnet_vlbert_for_pretraining_multitask.py",
    "vqa/function/config.py", "refcoco/function/config.py", "pretrain/function/config.py",
    "cfgs/vqa/base_4x16G_fp32.yaml", "cfgs/refcoco/base_detected_regions_4x16G.yaml",
    "cfgs/pretrain/base_prec_4x16G_fp32.yaml", "cfgs/pretrain/base_e2e_16x16G_fp16.yaml",
)
TASKS = {  # fixture name -> (task package, module file, class, yaml)
    "vqa": ("vqa", "resnet_vlbert_for_vqa", "ResNetVLBERT", "cfgs/vqa/base_4x16G_fp32.yaml"),
    "refcoco": ("refcoco", "resnet_vlbert_for_refcoco", "ResNetVLBERT", "cfgs/refcoco/base_detected_regions_4x16G.yaml"),
    "pretrain": ("pretrain", "resnet_vlbert_for_pretraining_multitask", "ResNetVLBERTForPretrainingMultitask",
                 "cfgs/pretrain/base_prec_4x16G_fp32.yaml"),
}
E2E_PRETRAIN_YAML = "cfgs/pretrain/base_e2e_16x16G_fp16.yaml"
TINY_VLBERT = dict(  # widths no two roles share, so a transposed or swapped tensor shows
    hidden_size=32, visual_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40,
    max_position_embeddings=24, vocab_size=128,
)
TINY_ANSWERS, TINY_REGION_CLASSES = 7, 9
FEAT_DIM = 2048  # FastRCNN.obj_downsample reads 2 * 2048 values: 2048-d geometry and 2048-d features, fixed
SHAPES = {  # name -> (batch, question/expression length, detector regions, words per row, regions per row)
    "a": (3, 6, 5, (6, 4, 2), (5, 3, 1)),
    "b": (2, 9, 7, (3, 9), (7, 2)),
}
IMAGE_WH = ((640, 480), (500, 375), (320, 320))
UNUSED = 99
SEED = 0


class AttrDict(dict):
    """easydict.EasyDict's behaviour, for machines without it: nested dicts read and written as attributes."""

    def __init__(self, d=None, **kw):
        super().__init__()
        for k, v in {**(d or {}), **kw}.items():
            self[k] = v

    def __setitem__(self, k, v):
        super().__setitem__(k, AttrDict(v) if isinstance(v, dict) and not isinstance(v, AttrDict) else v)

    __setattr__ = __setitem__

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


def import_reference(reference: Path) -> None:
    """The reference importable offline and without its compiled ROI ops: easydict is stood in for where it is not
    installed, and the ROIPool/ROIAlign extension (used only by the ResNet path, never run here) is an empty module."""
    try:
        import easydict  # noqa: F401
    except ImportError:
        sys.modules["easydict"] = types.SimpleNamespace(EasyDict=AttrDict)
    sys.modules["common.lib.roi_pooling.C_ROIPooling"] = types.ModuleType("C_ROIPooling")
    sys.path.insert(0, str(reference))


def task_config(reference: Path, task: str, yaml_file: str, bert_dir: Path, tiny: bool, precomputed: bool):
    """The reference's config module of `task`, updated from its yaml by its own update_config (yaml.load given the
    safe loader PyYAML 6 needs), then the tiny sizes."""
    import importlib

    import yaml

    module = importlib.import_module(f"{task}.function.config")
    module = importlib.reload(module)  # a fresh config for every model
    module.yaml = types.SimpleNamespace(load=yaml.safe_load)
    module.update_config(str(reference / yaml_file))
    cfg = module.config
    cfg.NETWORK.BERT_MODEL_NAME = str(bert_dir)
    cfg.NETWORK.BERT_PRETRAINED = ""
    cfg.NETWORK.PARTIAL_PRETRAIN = ""
    cfg.NETWORK.IMAGE_FEAT_PRECOMPUTED = precomputed
    if tiny:
        cfg.NETWORK.VLBERT.update(TINY_VLBERT)
        cfg.NETWORK.IMAGE_FINAL_DIM = TINY_VLBERT["visual_size"]
        if task == "vqa":
            cfg.DATASET.ANSWER_VOCAB_SIZE = TINY_ANSWERS
        cfg.NETWORK.VLBERT.visual_region_classes = TINY_REGION_CLASSES
    return cfg


def build(reference: Path, name: str, bert_dir: Path, tiny: bool = True, precomputed: bool = True,
          yaml_file: str | None = None) -> nn.Module:
    import importlib

    task, module_file, cls, default_yaml = TASKS[name]
    cfg = task_config(reference, task, yaml_file or default_yaml, bert_dir, tiny, precomputed)
    module = importlib.import_module(f"{task}.modules.{module_file}")
    return getattr(module, cls)(cfg)


def write_bert(bert_dir: Path) -> None:
    """The language model the task models start from: vocab.txt and the reference's own BertForPreTraining at the
    tiny size (the VQA model's `mlm` classifier copies its transform; every weight is replaced afterwards)."""
    from external.pytorch_pretrained_bert.modeling import BertConfig, BertForPreTraining

    bert_dir.mkdir(parents=True, exist_ok=True)
    write_vocab(bert_dir / "vocab.txt", TINY_VLBERT["vocab_size"])
    config = BertConfig(vocab_size_or_config_json_file=TINY_VLBERT["vocab_size"], hidden_size=TINY_VLBERT["hidden_size"],
                        num_hidden_layers=TINY_VLBERT["num_hidden_layers"],
                        num_attention_heads=TINY_VLBERT["num_attention_heads"],
                        intermediate_size=TINY_VLBERT["intermediate_size"],
                        max_position_embeddings=TINY_VLBERT["max_position_embeddings"], type_vocab_size=2)
    torch.save(BertForPreTraining(config).state_dict(), bert_dir / "pytorch_model.bin")
    (bert_dir / "bert_config.json").write_text(config.to_json_string())


def is_norm(module: nn.Module) -> bool:
    """The reference's LayerNorms (BertLayerNorm of its BERT, torch's LayerNorm elsewhere)."""
    return type(module).__name__.endswith("LayerNorm")


def released(model: nn.Module) -> dict:
    """What common/callbacks/epoch_end_callbacks/checkpoint.py saves of a DistributedDataParallel model."""
    return {"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}


def inputs(shape: str, vocab_size: int) -> dict[str, torch.Tensor]:
    """Detector regions in pixels (B, N, 4), their features, each image's feature and size, and the words (ids of
    the question / expression without [CLS] and [SEP], padded with 0), as the datasets hand them to the models."""
    b, length, n, words, counts = SHAPES[shape]
    g = torch.Generator().manual_seed(SEED + ord(shape))
    wh = torch.tensor(IMAGE_WH[:b], dtype=torch.float32)  # (B, 2) w, h
    lo = torch.rand(b, n, 2, generator=g) * 0.5
    hi = lo + 0.1 + torch.rand(b, n, 2, generator=g) * 0.4
    boxes = torch.cat([lo, hi], -1) * wh.repeat(1, 2)[:, None]  # (B, N, 4) pixel x1 y1 x2 y2
    region_mask = (torch.arange(n) < torch.tensor(counts)[:, None]).long()
    word_mask = (torch.arange(length) < torch.tensor(words)[:, None]).long()
    features = torch.randn(b, n, FEAT_DIM, generator=g).relu() * region_mask[..., None]
    # image "a": the image's own feature (image_box_feature); image "b": the mean of its regions', as the VQA dataset
    # computes it where the precomputed file has none
    image_feature = (torch.randn(b, FEAT_DIM, generator=g).relu() if shape == "a"
                     else features.sum(1) / region_mask.sum(1, keepdim=True))
    return {
        "words": torch.randint(UNUSED + 5, vocab_size, (b, length), generator=g) * word_mask,
        "boxes": boxes * region_mask[..., None],
        "region_features": features,
        "region_mask": region_mask,
        "image_feature": image_feature,
        "image_wh": wh,
    }


def reference_boxes(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The datasets' `boxes` (B, 1 + N, 4 + 2048) with the whole image first and -2 padding, and `im_info`."""
    b = x["boxes"].shape[0]
    w, h = x["image_wh"][:, 0], x["image_wh"][:, 1]
    whole = torch.stack([torch.zeros(b), torch.zeros(b), w, h], -1)[:, None]  # (B, 1, 4)
    rows = torch.cat([torch.cat([whole, x["image_feature"][:, None]], -1),
                      torch.cat([x["boxes"], x["region_features"]], -1)], 1)
    mask = torch.cat([torch.ones(b, 1, dtype=torch.long), x["region_mask"]], 1)
    rows[mask == 0] = -2.0
    im_info = torch.stack([w, h, torch.ones(b), torch.ones(b)], -1)
    return rows, im_info


class Recorder:
    """Forward hooks on VisualLinguisticBert: what the task module gave it and its last hidden states."""

    def __init__(self, model: nn.Module):
        self.seen: dict[str, torch.Tensor] = {}
        model.vlbert.register_forward_hook(self.inputs, with_kwargs=True)
        model.vlbert.encoder.register_forward_hook(self.hidden)

    def inputs(self, module, args, kwargs, output):
        names = ("text_input_ids", "text_token_type_ids", "text_visual_embeddings", "text_mask",
                 "object_vl_embeddings", "object_mask")
        self.seen.update({n: a for n, a in zip(names, args)})

    def hidden(self, module, args, output):
        self.seen["hidden"] = output[-1]


@torch.no_grad()
def run_vqa(model, x):
    rec = Recorder(model)
    boxes, im_info = reference_boxes(x)
    out = model.inference_forward(None, boxes, im_info, x["words"])
    return {"vqa": out["label_logits"], **recorded(rec)}


@torch.no_grad()
def run_refcoco(model, x):
    rec = Recorder(model)
    boxes, im_info = reference_boxes(x)
    out = model.inference_forward(None, boxes, im_info, x["words"])
    return {"refer": out["label_logits"], "pred_boxes": out["pred_boxes"], **recorded(rec)}


@torch.no_grad()
def run_pretrain(model, x, vocab_size: int):
    """ResNetVLBERTForPretrainingMultitask.forward with nothing masked (mvrc_ops 0) and one text-only row of the
    auxiliary corpus (its forward needs one); the heads' logits of the image rows are what is compared."""
    rec = Recorder(model)
    boxes, im_info = reference_boxes(x)
    b = boxes.shape[0]
    text = with_cls_sep(x["words"])
    n = boxes.shape[1]
    g = torch.Generator().manual_seed(SEED + 7)
    aux_text = with_cls_sep(torch.randint(UNUSED + 5, vocab_size, (1, 4), generator=g))
    out = model(None, boxes, im_info, text, torch.zeros(b, dtype=torch.long), torch.full_like(text, -1),
                torch.zeros(b, n, dtype=torch.long), torch.zeros(b, n, TINY_REGION_CLASSES),
                aux_text, torch.full_like(aux_text, -1))[0]
    seen = recorded(rec)
    return {"mlm": out["mlm_logits_wvc"][:, : text.shape[1]], "mrc": out["mvrc_logits"][:, :n],
            "text_input_ids": text, **{k: v[:b] for k, v in seen.items()}}


def with_cls_sep(words: torch.Tensor) -> torch.Tensor:
    """[CLS] words [SEP] padded with 0: the pretraining datasets' text."""
    ids = torch.zeros(words.shape[0], words.shape[1] + 2, dtype=torch.long)
    ids[:, 0] = 101
    ids[:, 1:-1] = words
    ids[torch.arange(words.shape[0]), (words > 0).sum(1) + 1] = 102
    return ids


def recorded(rec: Recorder) -> dict[str, torch.Tensor]:
    seen = rec.seen
    return {"text_input_ids": seen["text_input_ids"], "text_token_type_ids": seen["text_token_type_ids"],
            "text_mask": seen["text_mask"].long(), "object_mask": seen["object_mask"].long(), "hidden": seen["hidden"]}


def shapes(model: nn.Module) -> dict[str, list[int]]:
    return {key: list(t.shape) for key, t in released(model)["state_dict"].items()}


def full_size_manifest(reference: Path, bert_dir: Path) -> dict:
    """Key -> shape of every released layout at base size, from modules built on the meta device. The ResNet
    backbone's and the language model's weight loading in the modules' init_weight is skipped (no files, no
    memory): the module tree, which fixes the keys, is the reference's own."""
    import common.fast_rcnn as fast_rcnn

    real = {n: getattr(fast_rcnn, n) for n in ("resnet101",)}
    fast_rcnn.resnet101 = lambda pretrained=True, **kw: real["resnet101"](pretrained=False, **kw)
    skipped = []
    for task, module_file, cls, _ in TASKS.values():
        module = __import__(f"{task}.modules.{module_file}", fromlist=[cls])
        klass = getattr(module, cls)
        skipped.append((klass, klass.init_weight))
        klass.init_weight = lambda self: None
    plain = bert_dir.parent / "bert-base"
    plain.mkdir(exist_ok=True)
    (plain / "vocab.txt").write_text((bert_dir / "vocab.txt").read_text())  # no pytorch_model.bin: nothing loaded
    try:
        with torch.device("meta"):
            return {
                "vl-bert-base-e2e.model": shapes(build(reference, "pretrain", plain, tiny=False, precomputed=False,
                                                       yaml_file=E2E_PRETRAIN_YAML)),
                "vl-bert-base-prec.model": shapes(build(reference, "pretrain", plain, tiny=False)),
                "vqa-base.model": shapes(build(reference, "vqa", plain, tiny=False)),
                "refcoco+-base.model": shapes(build(reference, "refcoco", plain, tiny=False, precomputed=False)),
            }
    finally:
        fast_rcnn.resnet101 = real["resnet101"]
        for klass, init in skipped:
            klass.init_weight = init


def dump_yaml(path: Path, reference: Path, name: str) -> None:
    """The task's yaml with the tiny sizes written in (what the importer reads beside the checkpoint)."""
    import yaml

    data = yaml.safe_load((reference / TASKS[name][3]).read_text())
    vlbert = data["NETWORK"]["VLBERT"]
    vlbert.update(TINY_VLBERT)
    data["NETWORK"]["IMAGE_FINAL_DIM"] = TINY_VLBERT["visual_size"]
    data["NETWORK"]["IMAGE_FEAT_PRECOMPUTED"] = True
    if name == "pretrain":
        vlbert["visual_region_classes"] = TINY_REGION_CLASSES
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def main() -> None:
    parser = arguments(__doc__, "jackroos/VL-BERT checkout or archive", "vl_bert")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vl_bert_reference_work"),
                        help="scratch directory for the tiny language model the reference starts from")
    opts = parser.parse_args()
    reference = opts.reference.resolve()
    record = provenance(reference, opts.commit, REPOSITORY, USED_FILES)
    import_reference(reference)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    bert_dir = opts.work / "bert-tiny"
    write_bert(bert_dir)

    models = {name: randomize(build(reference, name, bert_dir), SEED + i, is_norm) for i, name in enumerate(TASKS)}
    for name, model in models.items():
        torch.save(released(model), out / f"{name}.model")
        dump_yaml(out / f"{name}.yaml", reference, name)
    (out / "vocab.txt").write_text((bert_dir / "vocab.txt").read_text())
    answers = reference / "data/coco/vqa/answers_vqa.txt"
    names = (answers.read_text().splitlines()[:TINY_ANSWERS] if answers.is_file()
             else ["yes", "no", "2", "1", "white", "3", "red"][:TINY_ANSWERS])
    (out / "answers_vqa.txt").write_text("\n".join(names) + "\n")

    tensors = {}
    for shape in SHAPES:
        x = inputs(shape, TINY_VLBERT["vocab_size"])
        tensors |= {f"{shape}.{k}": v for k, v in x.items()}
        for name, run in (("vqa", run_vqa), ("refcoco", run_refcoco)):
            tensors |= {f"{shape}.{name}.{k}": v for k, v in run(models[name], x).items()}
        tensors |= {f"{shape}.pretrain.{k}": v
                    for k, v in run_pretrain(models["pretrain"], x, TINY_VLBERT["vocab_size"]).items()}
    save_tensors(tensors, out / "reference.safetensors")

    (out / "manifest_full.json").write_text(json.dumps(full_size_manifest(reference, bert_dir), indent=0) + "\n")
    record |= {"tiny": {"vlbert": TINY_VLBERT, "answers": TINY_ANSWERS, "region_classes": TINY_REGION_CLASSES,
                        "shapes": {k: list(map(list, v[3:])) for k, v in SHAPES.items()}},
               "torch": torch.__version__, "generator": "scripts/reference_fixtures/vl_bert.py"}
    write_record(out, record)


if __name__ == "__main__":
    main()
