"""Fixture for `vlserve import vilbert`: facebookresearch/vilbert-multi-task's ViLBERT at tiny configs.

    python scripts/reference_fixtures/vilbert.py REFERENCE [--commit SHA] [--out DIR]

REFERENCE is a checkout (or an archive) of facebookresearch/vilbert-multi-task; it is read, never copied into
vlserve. The script builds the reference's own models (vilbert/vilbert.py) with seeded random weights, saves them as
its training scripts save them (`torch.save(model.state_dict())`, train_concap.py / train_tasks.py), runs them on
fixed inputs (padded text; padded regions led by the [IMG] whole-image region, with the 5-d locations its feature
reader builds) and writes into DIR (default tests/fixtures/vilbert):
  pretrained_model.bin     BertForMultiModalPreTraining.state_dict() (the README's pretrained_model.bin)
  pretrained_config.json   its tiny config, in the layout of config/bert_base_*.json
  multi_task_model.bin     VILBertForVLTasks.state_dict() with task tokens (train_tasks.py --task_specific_tokens, as
                           the README's 12-in-1 multi_task_model.bin was trained)
  multi_task_config.json   its tiny config
  vocab.txt                a tiny vocabulary with bert-base-uncased's special ids ([PAD] 0, [CLS] 101, [SEP] 102)
  reference.safetensors    inputs (our layout: regions without [IMG], normalized x1 y1 x2 y2 boxes) and the
                           reference's outputs of every head, at two padded shapes (`a.*`, `b.*`); the 12-in-1 heads
                           once per task token (task_utils.py's ForwardModelsVal: `task{id}.*`), NLVR2 on image pairs
  reference.json           repository, commit, sha256 of every reference file used, the configs
  manifest_full.json       key -> shape of both files at full size, from the reference's module tree built on the
                           meta device, and the fields of the config they were built from
                           (config/bert_base_6layer_6conect.json)
The two tiny configs place their co-attention layers differently (v_biattention_id / t_biattention_id), so both the
image layers interleaved between co-attention layers and those run after the last one are exercised.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: reference_fixtures.common
from reference_fixtures.common import (  # noqa: E402
    arguments, padded_text_and_boxes, provenance, randomize, save_tensors, shapes, stub_s3, write_record, write_vocab,
)

REPOSITORY = "facebookresearch/vilbert-multi-task"
USED_FILES = ("vilbert/vilbert.py", "vilbert/utils.py", "vilbert/task_utils.py", "vilbert_tasks.yml",
              "vilbert/datasets/_image_features_reader.py", "config/bert_base_6layer_6conect.json")
FULL_CONFIG = "config/bert_base_6layer_6conect.json"  # the config both published files were trained with
TINY_COMMON = dict(  # widths that no two roles share, so a transposed or swapped tensor shows
    vocab_size=128, hidden_size=32, num_attention_heads=2, intermediate_size=40, max_position_embeddings=24,
    type_vocab_size=2, hidden_act="gelu", v_feature_size=2048, v_target_size=11, v_hidden_size=24,
    v_num_attention_heads=2, v_intermediate_size=36, bi_hidden_size=16, bi_num_attention_heads=2, v_hidden_act="gelu",
    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, v_hidden_dropout_prob=0.1,
    v_attention_probs_dropout_prob=0.1, initializer_range=0.02, v_initializer_range=0.02, pooling_method="mul",
)
TINY_PRETRAINED = dict(TINY_COMMON, num_hidden_layers=4, v_num_hidden_layers=3,  # two image layers between the
                       v_biattention_id=[0, 2], t_biattention_id=[1, 1])  # co-attention layers, no text layer
TINY_MULTI_TASK = dict(TINY_COMMON, num_hidden_layers=4, v_num_hidden_layers=2,  # bert_base_6layer_6conect's layout:
                       v_biattention_id=[0, 1], t_biattention_id=[2, 3])  # one text and one image layer between
TASKS = (1, 7, 9, 12, 15)  # task tokens run: VQA, RetrievalCOCO, refcoco, NLVR2, GQA (vilbert_tasks.yml task_id)
SHAPES = {  # batch, words, regions (without [IMG]); per row: real words, real regions
    "a": dict(batch=4, words=8, regions=5, text=(8, 6, 4, 7), real=(5, 4, 2, 3)),
    "b": dict(batch=2, words=5, regions=3, text=(3, 5), real=(3, 1)),
}
SEED = 0
NORMS = ("BertLayerNorm", "LayerNorm", "FusedLayerNorm")  # the reference's LayerNorm classes (apex's when installed)


def import_reference(reference: Path):
    """vilbert/vilbert.py, importable offline: the imports of vilbert/utils.py that only its downloader and training
    logger use (boto3, botocore, tensorboardX) are stubbed, and torch._six (gone from torch 2) gives its `inf`.
    apex is absent, so the reference's own BertLayerNorm (TF-style LayerNorm) runs."""
    stub_s3("tensorboardX", "torch._six")
    sys.modules["tensorboardX"].SummaryWriter = object
    sys.modules["torch._six"].inf = float("inf")
    sys.path.insert(0, str(reference))
    from vilbert import vilbert

    return vilbert


def config_of(vilbert, fields: dict, task_tokens: bool):
    """BertConfig as train_tasks.py builds it: from_json_file's defaults then the file's fields."""
    config = vilbert.BertConfig.from_dict(fields)
    config.task_specific_tokens = task_tokens
    return config


def is_norm(module: nn.Module) -> bool:
    return type(module).__name__ in NORMS


def inputs(shape: dict, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Our layout: text padded with [PAD], regions (zeros where padded), normalized boxes, masks."""
    g = torch.Generator().manual_seed(seed)
    b, t, n = shape["batch"], shape["words"], shape["regions"]
    ids, text_mask, region_mask, boxes = padded_text_and_boxes(g, vocab_size, b, t, n, shape["text"], shape["real"])
    features = torch.rand(b, n, TINY_COMMON["v_feature_size"], generator=g) * 2  # non-negative, as pooled ReLU maps
    return {
        "input_ids": ids,
        "attention_mask": text_mask,
        "token_type_ids": torch.randint(0, 2, (b, t), generator=g) * text_mask,
        "region_features": features * region_mask[..., None],
        "region_boxes": boxes * region_mask[..., None],
        "region_mask": region_mask,
    }


def reference_regions(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the reference's ImageFeaturesH5Reader and datasets feed: [IMG] first (the mean of the real regions'
    features, location 0 0 1 1 1), then each region's x1/w, y1/h, x2/w, y2/h and its area fraction; padding zeros."""
    mask = x["region_mask"]
    feats, boxes = x["region_features"], x["region_boxes"]
    g_feat = feats.sum(1) / mask.sum(1, keepdim=True)
    area = (boxes[..., 3] - boxes[..., 1]) * (boxes[..., 2] - boxes[..., 0])
    loc = torch.cat([boxes, area[..., None]], -1) * mask[..., None]
    g_loc = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]).expand(mask.shape[0], 1, 5)
    return (torch.cat([g_feat[:, None], feats], 1), torch.cat([g_loc, loc], 1),
            torch.cat([mask.new_ones(mask.shape[0], 1), mask], 1))


@torch.no_grad()
def pretrained_outputs(model: nn.Module, x: dict[str, torch.Tensor], tag: str) -> dict[str, torch.Tensor]:
    """BertForMultiModalPreTraining.forward without labels: its three heads' scores (regions: [IMG] first)."""
    feats, loc, vmask = reference_regions(x)
    mlm, mrc, itm, _ = model(x["input_ids"], feats, loc, x["token_type_ids"], x["attention_mask"], vmask)
    return {f"{tag}.pretrained.mlm": mlm, f"{tag}.pretrained.mrc": mrc, f"{tag}.pretrained.itm": itm}


@torch.no_grad()
def multi_task_outputs(model: nn.Module, x: dict[str, torch.Tensor], tag: str) -> dict[str, torch.Tensor]:
    """VILBertForVLTasks.forward once per task token (ForwardModelsVal fills task_tokens with the task's id) on every
    row; NLVR2's pass (task 12) on ForwardModelsVal's "nlvr" layout: each statement twice, its two images' regions."""
    feats, loc, vmask = reference_regions(x)
    names = ("vil_prediction", "vil_prediction_gqa", "vil_logit", "vil_binary_prediction", "vil_tri_prediction",
             "vision_prediction", "vision_logit", "linguisic_prediction", "linguisic_logit")
    out = {}
    for task in TASKS:
        ids = x["input_ids"].new_full((x["input_ids"].shape[0], 1), task)
        if task == 12:
            pairs = {k: v[0::2].repeat_interleave(2, 0) if k in ("input_ids", "attention_mask", "token_type_ids") else v
                     for k, v in x.items()}  # rows 2i and 2i+1: one statement, two images
            results = model(pairs["input_ids"], feats, loc, pairs["token_type_ids"], pairs["attention_mask"], vmask,
                            None, ids)
            out[f"{tag}.task12.vil_binary_prediction"] = results[3]
            continue
        results = model(x["input_ids"], feats, loc, x["token_type_ids"], x["attention_mask"], vmask, None, ids)
        wanted = {1: ("vil_prediction", "vil_tri_prediction"), 7: ("vil_logit",), 9: ("vision_logit",),
                  15: ("vil_prediction_gqa",)}[task]
        out |= {f"{tag}.task{task}.{name}": value for name, value in zip(names, results) if name in wanted}
    return out


def main() -> None:
    opts = arguments(__doc__, "facebookresearch/vilbert-multi-task checkout or archive", "vilbert").parse_args()
    reference = opts.reference.resolve()
    record = provenance(reference, opts.commit, REPOSITORY, USED_FILES)
    vilbert = import_reference(reference)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    # tiny models: weights in the reference's file format, and its outputs
    pretrained = randomize(vilbert.BertForMultiModalPreTraining(config_of(vilbert, TINY_PRETRAINED, False)), SEED,
                           is_norm)
    multi_task = randomize(vilbert.VILBertForVLTasks(config_of(vilbert, TINY_MULTI_TASK, True), num_labels=3129),
                           SEED + 1, is_norm)
    torch.save(pretrained.state_dict(), out / "pretrained_model.bin")
    torch.save(multi_task.state_dict(), out / "multi_task_model.bin")
    (out / "pretrained_config.json").write_text(json.dumps(TINY_PRETRAINED, indent=2) + "\n")
    (out / "multi_task_config.json").write_text(json.dumps(TINY_MULTI_TASK, indent=2) + "\n")
    tensors = {}
    for i, (tag, shape) in enumerate(SHAPES.items()):
        x = inputs(shape, TINY_COMMON["vocab_size"], SEED + i)
        tensors |= {f"{tag}.{k}": v for k, v in x.items()}
        tensors |= pretrained_outputs(pretrained, x, tag) | multi_task_outputs(multi_task, x, tag)
    save_tensors(tensors, out / "reference.safetensors")
    write_vocab(out / "vocab.txt", TINY_COMMON["vocab_size"])

    # full size: the key and shape of every tensor, from modules built without memory
    full_fields = json.loads((reference / FULL_CONFIG).read_text())
    with torch.device("meta"):
        full = {"config": full_fields,
                "pretrained_model.bin": shapes(vilbert.BertForMultiModalPreTraining(config_of(vilbert, full_fields, False))),
                "multi_task_model.bin": shapes(vilbert.VILBertForVLTasks(config_of(vilbert, full_fields, True), 3129))}
    (out / "manifest_full.json").write_text(json.dumps(full, indent=0) + "\n")

    record |= {"tiny": {"pretrained": TINY_PRETRAINED, "multi_task": TINY_MULTI_TASK, "shapes": SHAPES,
                        "tasks": TASKS},
               "full": {"config": FULL_CONFIG},
               "torch": torch.__version__, "generator": "scripts/reference_fixtures/vilbert.py"}
    write_record(out, record)


if __name__ == "__main__":
    main()
