"""Fixture for `vlserve import volta`: VOLTA's own models (github.com/e-bug/volta) at tiny configs.

    python scripts/reference_fixtures/volta.py REFERENCE [--commit SHA] [--out DIR]

REFERENCE is a checkout (or an archive) of e-bug/volta; it is read, never copied into vlserve. The script builds the
reference's BertForVLTasks and BertForVLPreTraining (volta/encoders.py) from five tiny config jsons laid out as its
published ones, fills every parameter with seeded values, saves the state dicts as its train_task.py /
train_concap.py do (volta/train_utils.py save: torch.save(model.state_dict())), runs them on fixed padded inputs of
two shapes laid out as its feature reader lays them out (with add_global_imgfeat "first" the whole-image feature
first: the mean of the real regions, location [0, 0, 1, 1, 1]; num_locs-d locations x1 y1 x2 y2 (area),
normalized; the VL-BERT-style model one example at a time: see per_example) and writes into DIR (default
tests/fixtures/volta), for each config in its folder:
  vilbert_tiny.json (top)  ViLBERT-style, as config/vilbert_base.json (a co-attention width and heads of its own,
                           a pooler width of its own), smaller
  ctrl_lxmert/             LXMERT-style, as config/ctrl_lxmert.json (whole image first, 5-d locations, poolers
                           multiplied)
  original_lxmert/         VOLTA's conversion of LXMERT, as config/original_lxmert.json (no whole image, 4-d boxes,
                           the text's pooler alone, object / attribute / feature targets, image QA)
  ctrl_visualbert/         VisualBERT-style, as config/ctrl_visualbert_base.json (one shared stack, whole image first,
                           poolers multiplied)
  ctrl_vl-bert/            VL-BERT-style, as config/ctrl_vl-bert_base.json (VisualBERT's stack over VL-BERT's
                           embeddings: three segments, sin/cos box geometry, the last region slot [END]; no LayerNorm
                           in the region-class head)
  pytorch_model_best.bin   BertForVLTasks with the task heads of config_tasks/vilbert_trainval_tasks.yml's TASK1
                           (VQA, 7 answers here), TASK8 (Flickr30k retrieval), TASK10 (RefCOCO+), TASK12 (NLVR2) and
                           TASK13 (visual entailment, which vlserve has no endpoint for)
  pytorch_model_9.bin      BertForVLPreTraining (masked LM, ITM, the config's visual targets, image QA)
  vocab.txt                a tiny vocabulary with bert-base-uncased's special ids
  reference.safetensors    inputs and the reference's outputs of every head (`tasks.*`, `pre.*`; `wide.*` at the
                           second shape)
and at the top:
  tasks.yml                the task table used (types and label counts from vilbert_trainval_tasks.yml)
  label2ans.json           the VQA head's answers (7 names)
  reference.json           repository, commit, sha256 of every reference file used
  manifest_full.json       for config/ctrl_vilbert_base.json, vilbert_base.json, ctrl_lxmert.json,
                           original_lxmert.json, ctrl_visualbert_base.json and ctrl_vl-bert_base.json: the config and
                           the key -> shape of both models at full size (3129 VQA answers), from the reference's module
                           tree; the configs of vl-bert_base and ctrl_uniter_base, which vlserve refuses
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import yaml
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: reference_fixtures.common
from reference_fixtures.common import (  # noqa: E402
    arguments, padded_text_and_boxes, provenance, save_tensors, shapes, stub_s3, write_record, write_vocab,
)

REPOSITORY = "e-bug/volta"
USED_FILES = (  # the reference files this fixture comes from (hashed into reference.json)
    "volta/encoders.py", "volta/embeddings.py", "volta/config.py", "volta/utils.py", "volta/losses.py",
    "volta/train_utils.py", "volta/datasets/_image_features_reader.py", "config/vilbert_base.json",
    "config/ctrl_vilbert_base.json", "config_tasks/vilbert_trainval_tasks.yml", "config/ctrl_lxmert.json",
    "config/original_lxmert.json",
    "config/ctrl_visualbert_base.json", "config/ctrl_vl-bert_base.json", "config/ctrl_uniter_base.json",
    "config/vl-bert_base.json",
)
FULL_CONFIGS = ("ctrl_vilbert_base", "vilbert_base", "ctrl_lxmert", "original_lxmert", "ctrl_visualbert_base",
                "ctrl_vl-bert_base")
OTHER_CONFIGS = ("vl-bert_base", "ctrl_uniter_base")  # the whole image last and no pooler; UNITER's embeddings: refused
# text sublayers 0-3 (two text layers), co-attention 4-5, text + image layer 6-7, co-attention 8-9, image layer
# 10-11: three text layers, two image layers, co-attention after text layers 2 and 3 (as vilbert_base.json, smaller)
TINY = {
    "vocab_size": 128, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 40,
    "max_position_embeddings": 20, "type_vocab_size": 2, "pooler_size": 20, "v_pooler_size": 20,
    "v_feature_size": 24, "v_hidden_size": 12, "v_num_attention_heads": 2, "v_intermediate_size": 28,
    "clf_hidden_size": 36, "num_locs": 5, "add_global_imgfeat": "first", "image_embeddings": "vilbert",
    "bert_model": "bert-base-uncased", "model": "bert", "fusion_method": "mul", "visual_target_weights": {"0": 1.0},
    "hidden_act": "gelu", "v_hidden_act": "gelu",
    "tt_attn_sublayers": [0, 2, 6], "tv_attn_sublayers": [4, 8], "vt_attn_sublayers": [4, 8],
    "vv_attn_sublayers": [6, 10], "t_ff_sublayers": [1, 3, 5, 7, 9], "v_ff_sublayers": [5, 7, 9, 11],
    "shared_sublayers": [], "single_ln_sublayers": [],
    "sublayer2attn_hidden_size": {"4": 12, "8": 12}, "sublayer2num_attention_heads": {"4": 3, "8": 3},
    "sublayer2intermediate_size": {}, "sublayer2v_attn_hidden_size": {}, "sublayer2v_num_attention_heads": {"4": 3, "8": 3},
    "sublayer2v_intermediate_size": {},
}
_LXMERT_BASE = {k: v for k, v in TINY.items() if not k.startswith(("sublayer2", "tt_", "tv_", "vt_", "vv_", "t_ff", "v_ff"))}
# LXMERT-style (as config/ctrl_lxmert.json, smaller): one width for both streams, two language layers and one
# object-relationship layer side by side (sublayers 0-3), then two cross-modality layers of three sublayers each
# (shared text-vision attention, self-attention, feed-forward)
_LXMERT_LAYERS = {
    "tt_attn_sublayers": [0, 2, 5, 8], "tv_attn_sublayers": [4, 7], "vt_attn_sublayers": [4, 7],
    "vv_attn_sublayers": [0, 5, 8], "t_ff_sublayers": [1, 3, 6, 9], "v_ff_sublayers": [1, 6, 9],
    "shared_sublayers": [4, 7], "single_ln_sublayers": [],
    "sublayer2attn_hidden_size": {}, "sublayer2num_attention_heads": {}, "sublayer2intermediate_size": {},
    "sublayer2v_attn_hidden_size": {}, "sublayer2v_num_attention_heads": {}, "sublayer2v_intermediate_size": {},
}
TINY_LXMERT = {  # the controlled LXMERT: whole image first, 5-d locations, the two poolers multiplied
    **_LXMERT_BASE, **_LXMERT_LAYERS, "image_embeddings": "lxmert", "v_hidden_size": 16, "v_intermediate_size": 40,
}
TINY_LXMERT_CONVERTED = {  # VOLTA's conversion of the original LXMERT (config/original_lxmert.json): no whole image,
    # 4-d boxes, the text's ReLU pooler alone (as wide as the text: its image-QA head reads it), object class,
    # attribute and feature targets (2048-d: its losses regress the input features), the 9-answer image-QA head
    **TINY_LXMERT, "add_global_imgfeat": None, "num_locs": 4, "fusion_method": "text", "pooler_size": 16,
    "v_feature_size": 2048,
    "v_pooler_size": None, "visual_target_weights": {"3": 6.667, "4": 6.667, "5": 6.667}, "qa_task_weight": 1,
    "qa_num_answers": 9,
}
_ALL = [0, 1, 2, 3, 4, 5]
TINY_VISUALBERT = {  # the controlled VisualBERT (config/ctrl_visualbert_base.json, smaller): three layers of one
    # shared stack over text and regions (all four attentions in each, one LayerNorm), the whole image first
    **_LXMERT_BASE, **{k: [] for k in _LXMERT_LAYERS if k.endswith("sublayers")},
    **{k: {} for k in _LXMERT_LAYERS if k.startswith("sublayer2")},
    "image_embeddings": "visualbert", "v_hidden_size": 16, "v_intermediate_size": 40,
    "tt_attn_sublayers": [0, 2, 4], "tv_attn_sublayers": [0, 2, 4], "vt_attn_sublayers": [0, 2, 4],
    "vv_attn_sublayers": [0, 2, 4], "t_ff_sublayers": [1, 3, 5], "v_ff_sublayers": [1, 3, 5],
    "shared_sublayers": _ALL, "single_ln_sublayers": _ALL,
}
TINY_VLBERT = {  # the controlled VL-BERT (config/ctrl_vl-bert_base.json, smaller): the same shared stack over
    # VL-BERT's embeddings (segments A, B and C; 8 x 3 sin/cos values of box geometry, as wide as the features, as
    # VOLTA's obj_downsample needs), the whole image first, poolers multiplied, no LayerNorm in the image head
    **TINY_VISUALBERT, "image_embeddings": "vl-bert", "type_vocab_size": 3, "v_coordinate_embeddings_dim": 3,
    "image_head_ln": False,
}
TINY_CONFIGS = {  # fixture folder (the ViLBERT-style model at the top) -> config json name, config
    "": ("vilbert_tiny.json", TINY),
    "ctrl_lxmert": ("ctrl_lxmert_tiny.json", TINY_LXMERT),
    "original_lxmert": ("original_lxmert_tiny.json", TINY_LXMERT_CONVERTED),
    "ctrl_visualbert": ("ctrl_visualbert_tiny.json", TINY_VISUALBERT),
    "ctrl_vl-bert": ("ctrl_vl-bert_tiny.json", TINY_VLBERT),
}
TASKS = ("TASK1", "TASK8", "TASK10", "TASK12", "TASK13")
VQA_ANSWERS, FULL_VQA_ANSWERS = 7, 3129
SHAPES = {  # prefix of the tensors -> text lengths and region counts per row (row 0 unpadded, the others padded)
    "": ((8, 6, 4), (5, 4, 2)),
    "wide.": ((11, 5), (7, 3)),  # a second padded shape: other batch, text and region sizes
}
SEED = 0


def import_reference(reference: Path):
    """volta.config and volta.encoders, importable offline and on the CPU: the S3 downloader's imports (volta/utils.py)
    are stubbed, never called (nothing is downloaded: every model is built from a config and filled with seeded
    values)."""
    stub_s3()
    sys.path.insert(0, str(reference))
    from volta import config, encoders

    # VisualBertEmbeddings.forward puts its visual position ids on the GPU (`.cuda()`); this runs on the CPU, where
    # the ids stay as they are
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    return config, encoders


def task_table(reference: Path, answers: int) -> dict:
    """The tasks' entries of the reference's task table (type, label count), the VQA head sized `answers`."""
    table = yaml.safe_load((reference / "config_tasks/vilbert_trainval_tasks.yml").read_text())
    tasks = {t: {k: table[t][k] for k in ("name", "type", "num_labels") if k in table[t]} for t in TASKS}
    tasks["TASK1"]["num_labels"] = answers
    return tasks


@torch.no_grad()
def randomize(model: nn.Module, seed: int) -> nn.Module:
    """Seeded values in every parameter (LayerNorm weights around 1): no output depends on an initializer."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # tied parameters appear once
        noise = 0.2 * torch.randn(p.shape, generator=g)
        p.copy_(1 + noise if "LayerNorm" in name and name.endswith("weight") or ".logit_fc.2.weight" in name else noise)
    return model.eval()


def inputs(vocab_size: int, feat_dim: int, text_lengths: tuple[int, ...], region_counts: tuple[int, ...],
           seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch, length, regions = len(text_lengths), text_lengths[0], region_counts[0]
    ids, text_mask, region_mask, boxes = padded_text_and_boxes(g, vocab_size, batch, length, regions, text_lengths,
                                                                region_counts)
    features = torch.randn(batch, regions, feat_dim, generator=g)
    second = torch.randn(batch, regions, feat_dim, generator=g)  # NLVR2's right-hand images
    second_boxes = boxes.flip(1)
    return {
        "input_ids": ids,
        "attention_mask": text_mask,
        "token_type_ids": torch.zeros(batch, length, dtype=torch.long),
        "region_features": features * region_mask[..., None],  # padding is zeros, as the feature reader pads
        "region_boxes": boxes * region_mask[..., None],
        "region_mask": region_mask,
        "region_features_right": second * region_mask[..., None],
        "region_boxes_right": second_boxes * region_mask[..., None],
    }


def volta_regions(features: torch.Tensor, boxes: torch.Tensor, mask: torch.Tensor, config):
    """The reference's image input as its feature reader builds it: with add_global_imgfeat "first" the whole-image
    feature first (the mean of the real regions' features, location [0, 0, 1, 1, 1]), then the regions with their
    num_locs-d locations (x1, y1, x2, y2 and the area when 5)."""
    if config.add_global_imgfeat is None:
        area = (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])
        return features, torch.cat([boxes, area[..., None]], -1)[..., : config.num_locs], mask
    m = mask[..., None].float()
    whole = (features * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)  # (B, 1, D)
    area = (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])
    loc = torch.cat([boxes, area[..., None]], -1)  # (B, N, 5)
    whole_loc = loc.new_tensor([0.0, 0.0, 1.0, 1.0, 1.0]).expand(loc.shape[0], 1, 5)
    return (torch.cat([whole, features], 1), torch.cat([whole_loc, loc], 1),
            torch.cat([mask.new_ones(mask.shape[0], 1), mask], 1))


@torch.no_grad()
def task_outputs(model: nn.Module, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BertForVLTasks.forward per task: the first of its outputs (vil_prediction) for each task id."""
    feats, locs, vmask = volta_regions(x["region_features"], x["region_boxes"], x["region_mask"], model.config)
    kw = dict(token_type_ids=x["token_type_ids"], attention_mask=x["attention_mask"], image_attention_mask=vmask)
    # VL-BERT-style embeddings write their mask embedding into all-zero (padded) features in place: a copy per call
    out = {f"tasks.{t}": model(x["input_ids"], feats.clone(), locs, t, **kw)[0]
           for t in ("TASK1", "TASK8", "TASK10", "TASK13")}
    # NLVR2: each statement twice, with its left then its right image (as nlvr2_dataset.py batches a pair)
    right = volta_regions(x["region_features_right"], x["region_boxes_right"], x["region_mask"], model.config)
    pair = lambda a, b: torch.stack([a, b], 1).flatten(0, 1)  # noqa: E731
    twice = lambda t: t.repeat_interleave(2, 0)  # noqa: E731
    out["tasks.TASK12"] = model(twice(x["input_ids"]), pair(feats, right[0]), pair(locs, right[1]), "TASK12",
                                token_type_ids=twice(x["token_type_ids"]), attention_mask=twice(x["attention_mask"]),
                                image_attention_mask=pair(vmask, right[2]))[0]
    return out


@torch.no_grad()
def pretraining_outputs(model: nn.Module, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What BertForVLPreTraining.forward computes before its losses (its bert, then its cls heads): masked-LM, ITM,
    image-QA and each visual target's scores."""
    feats, locs, vmask = volta_regions(x["region_features"], x["region_boxes"], x["region_mask"], model.config)
    text, image, pooled_t, pooled_v, _ = model.bert(x["input_ids"], feats, locs, x["token_type_ids"],
                                                    x["attention_mask"], vmask)
    mlm, visual, itm, qa, _ = model.cls(text, image, pooled_t, pooled_v)
    out = {"pre.mlm": mlm, "pre.itm": itm, **{f"pre.visual.{k}": v for k, v in visual.items()}}
    return out | ({"pre.image_qa": qa} if qa is not None else {})


def per_example(outputs, model: nn.Module, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`outputs(model, x)` one example at a time, concatenated. VOLTA's VLBertEmbeddings adds the region count to the
    position ids of padded text in place through an expanded (batch-shared) view, so a batched call moves every row's
    positions from the batch's shortest text on; alone, each example's own text length counts, as at batch size 1."""
    rows = [outputs(model, {k: v[i : i + 1] for k, v in x.items()}) for i in range(len(x["input_ids"]))]
    return {k: torch.cat([row[k] for row in rows]) for k in rows[0]}


def main() -> None:
    opts = arguments(__doc__, "e-bug/volta checkout or archive", "volta").parse_args()
    reference = opts.reference.resolve()
    record = provenance(reference, opts.commit, REPOSITORY, USED_FILES)
    vconfig, encoders = import_reference(reference)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    # tiny models: weights in the reference's file format, and its outputs
    tasks = task_table(reference, VQA_ANSWERS)
    (out / "tasks.yml").write_text(yaml.safe_dump(tasks, sort_keys=True))
    for folder, (config_name, tiny) in TINY_CONFIGS.items():
        where = out / folder
        where.mkdir(exist_ok=True)
        (where / config_name).write_text(json.dumps(tiny, indent=2) + "\n")
        config = vconfig.BertConfig.from_json_file(str(where / config_name))
        torch.manual_seed(SEED)
        fine_tuned = randomize(encoders.BertForVLTasks(copy.deepcopy(config), tasks, list(TASKS)), SEED)
        pretrained = randomize(encoders.BertForVLPreTraining(copy.deepcopy(config)), SEED + 1)
        torch.save(fine_tuned.state_dict(), where / "pytorch_model_best.bin")
        torch.save(pretrained.state_dict(), where / "pytorch_model_9.bin")
        write_vocab(where / "vocab.txt", tiny["vocab_size"])
        tensors = {}
        for i, (prefix, (text_lengths, region_counts)) in enumerate(SHAPES.items()):
            x = inputs(tiny["vocab_size"], tiny["v_feature_size"], text_lengths, region_counts, SEED + i)
            run = per_example if tiny["image_embeddings"] == "vl-bert" else lambda outputs, model, x: outputs(model, x)
            outputs = {**x, **run(task_outputs, fine_tuned, x), **run(pretraining_outputs, pretrained, x)}
            tensors |= {prefix + k: v for k, v in outputs.items()}
        save_tensors(tensors, where / "reference.safetensors")
    (out / "label2ans.json").write_text(json.dumps([f"answer {i}" for i in range(VQA_ANSWERS)]))

    # full size: the key and shape of every tensor, from modules built without memory
    full = {}
    full_tasks = task_table(reference, FULL_VQA_ANSWERS)
    for name in FULL_CONFIGS:
        cfg = vconfig.BertConfig.from_json_file(str(reference / "config" / f"{name}.json"))
        with torch.device("meta"):
            full[name] = {"config": json.loads((reference / "config" / f"{name}.json").read_text()),
                          "pytorch_model_best.bin": shapes(encoders.BertForVLTasks(copy.deepcopy(cfg), full_tasks, list(TASKS))),
                          "pytorch_model_9.bin": shapes(encoders.BertForVLPreTraining(copy.deepcopy(cfg)))}
    for name in OTHER_CONFIGS:
        full[name] = {"config": json.loads((reference / "config" / f"{name}.json").read_text())}
    (out / "manifest_full.json").write_text(json.dumps(full, indent=0) + "\n")

    record |= {"tiny": {"configs": {name: tiny for name, tiny in TINY_CONFIGS.values()}, "tasks": tasks}, "full": {"configs": list(FULL_CONFIGS), "tasks": full_tasks},
               "torch": torch.__version__, "generator": "scripts/reference_fixtures/volta.py"}
    write_record(out, record)


if __name__ == "__main__":
    main()
