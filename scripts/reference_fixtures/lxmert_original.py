"""Fixture for `vlserve import lxmert`: the original LXMERT code (github.com/airsplay/lxmert) at a tiny config.

    python scripts/reference_fixtures/lxmert_original.py REFERENCE [--commit SHA] [--out DIR]

REFERENCE is a checkout (or an archive) of airsplay/lxmert; it is read, never copied into vlserve. The script builds
the reference's own models with seeded random weights, saves them as its code saves them, runs them on fixed inputs
(padded text, padded regions) and writes into DIR (default tests/fixtures/lxmert_original):
  BEST.pth               VQAModel(7 answers).state_dict(), as src/tasks/vqa.py VQA.save writes a fine-tuned model
  model_LXRT.pth         nn.DataParallel(LXRTPretraining).state_dict() (`module.` keys), as
                         src/pretrain/lxmert_pretrain.py builds and saves (LXMERT.__init__, LXMERT.save)
  bert_config.json       the tiny BertConfig, written by the reference's BertConfig.to_json_string
  vocab.txt              a tiny vocabulary with bert-base-uncased's special ids ([PAD] 0, [CLS] 101, [SEP] 102, [MASK] 103)
  label2ans.json         the VQA head's answers: the first 7 of the reference's data/vqa/trainval_label2ans.json
  all_ans.json           the pretraining answer head's: the first 9 of its data/lxmert/all_ans.json
  reference.safetensors  inputs and the reference's outputs of every head (`best.*`, `lxrt.*`)
  reference.json         repository, commit, sha256 of every reference file used, the configs
  manifest_full.json     key -> shape of both files at full size (bert-base-uncased, 9/5/5 layers, 3129 VQA answers,
                         9500 pretraining answers), from the reference's module tree
The VQA model reads 16-d region features; the pretraining model 2048-d ones, the width its feature-regression head
has whatever the features (VisualConfig.visual_loss_config).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the reference's DataParallel stays on the CPU (and accepts meta modules)

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: reference_fixtures.common
from reference_fixtures.common import (  # noqa: E402
    arguments, padded_text_and_boxes, provenance, randomize, save_tensors, shapes, stub_s3, use_bert,
    write_record, write_vocab,
)

REPOSITORY = "airsplay/lxmert"
USED_FILES = (  # the reference files this fixture comes from (hashed into reference.json)
    "src/param.py", "src/lxrt/modeling.py", "src/lxrt/entry.py", "src/tasks/vqa_model.py", "src/tasks/vqa.py",
    "src/pretrain/lxmert_pretrain.py", "data/vqa/trainval_label2ans.json", "data/lxmert/all_ans.json",
)
TINY_BERT = dict(  # BertConfig fields; widths that no two roles share, so a transposed or swapped tensor shows
    vocab_size_or_config_json_file=128, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=40, max_position_embeddings=20, type_vocab_size=2,
)
TINY_LAYERS = dict(llayers=2, xlayers=2, rlayers=1)
FULL_LAYERS = dict(llayers=9, xlayers=5, rlayers=5)  # run/vqa_finetune.bash, run/lxmert_pretrain.bash
VQA_ANSWERS, QA_ANSWERS = 7, 9  # tiny answer heads (full size: 3129 VQA, 9500 pretraining)
FULL_VQA_ANSWERS, FULL_QA_ANSWERS = 3129, 9500
TINY_FEAT_DIM, FEAT_DIM = 16, 2048
BATCH, TEXT_LEN, REGIONS = 3, 8, 5
TEXT_LENGTHS, REGION_COUNTS = (8, 6, 4), (5, 4, 3)  # row 0 unpadded, the others padded
SEED = 0


def import_reference(reference: Path, layers: dict[str, int]):
    """The reference's modules, importable offline: its S3 downloader's imports are stubbed (never called), its
    argument parser reads the pretraining and layer flags of run/lxmert_pretrain.bash, from_pretrained builds the
    chosen BertConfig instead of downloading bert-base-uncased (every weight is replaced by seeded values), and
    LXRTEncoder.dim, which the reference fixes at BERT-base's 768, is that config's width."""
    stub_s3()
    sys.path.insert(0, str(reference / "src"))
    flags = ["--taskMaskLM", "--taskObjPredict", "--taskMatched", "--taskQA", "--visualLosses", "obj,attr,feat"]
    sys.argv = [sys.argv[0], *flags, *(x for k, v in layers.items() for x in (f"--{k}", str(v)))]
    from lxrt import entry, modeling
    from tasks import vqa_model

    entry.BertTokenizer.from_pretrained = classmethod(lambda cls, *a, **k: None)  # ids are given, never tokenized
    # LXRTEncoder.dim is 768 (BERT-base) in the reference; the task heads read it as the encoder's width
    entry.LXRTEncoder.dim = property(lambda self: self.model.config.hidden_size)
    return modeling, vqa_model


def set_layers(args, layers: dict[str, int]) -> None:
    for name, count in layers.items():
        setattr(args, name, count)


def build_vqa(modeling, vqa_model, feat_dim: int, answers: int) -> nn.Module:
    modeling.VISUAL_CONFIG.set_visual_dims(feat_dim, 4)
    return vqa_model.VQAModel(answers)


def build_pretraining(modeling, answers: int) -> nn.Module:
    """LXMERT.__init__ of lxmert_pretrain.py (flags of run/lxmert_pretrain.bash), then its --multiGPU wrapping."""
    modeling.VISUAL_CONFIG.set_visual_dims(FEAT_DIM, 4)
    args = sys.modules["param"].args
    model = modeling.LXRTPretraining.from_pretrained(
        "bert-base-uncased", task_mask_lm=args.task_mask_lm, task_obj_predict=args.task_obj_predict,
        task_matched=args.task_matched, task_qa=args.task_qa, visual_losses=args.visual_losses, num_answers=answers,
    )
    return nn.DataParallel(model)


def inputs(vocab_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    ids, text_mask, region_mask, boxes = padded_text_and_boxes(g, vocab_size, BATCH, TEXT_LEN, REGIONS,
                                                                TEXT_LENGTHS, REGION_COUNTS)
    return {
        "input_ids": ids,
        "attention_mask": text_mask,
        "token_type_ids": torch.randint(0, 2, (BATCH, TEXT_LEN), generator=g) * text_mask,
        "region_features": torch.randn(BATCH, REGIONS, TINY_FEAT_DIM, generator=g),
        "region_features_2048": torch.randn(BATCH, REGIONS, FEAT_DIM, generator=g),
        "region_boxes": boxes,
        "region_mask": region_mask,
    }


@torch.no_grad()
def vqa_outputs(model: nn.Module, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """VQAModel.forward on given ids: its LXRTEncoder.forward runs self.model(ids, segments, mask, visual_feats=...)
    after tokenizing; here the visual mask is passed too (LXRTFeatureExtraction.forward takes it)."""
    pooled = model.lxrt_encoder.model(x["input_ids"], x["token_type_ids"], x["attention_mask"],
                                      visual_feats=(x["region_features"], x["region_boxes"]),
                                      visual_attention_mask=x["region_mask"])
    return {"best.vqa": model.logit_fc(pooled)}


@torch.no_grad()
def pretraining_outputs(wrapped: nn.Module, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What LXRTPretraining.forward computes before its losses: every head's scores (it returns only the QA ones)."""
    model = wrapped.module
    (lang, visn), pooled = model.bert(x["input_ids"], x["token_type_ids"], x["attention_mask"],
                                      visual_feats=(x["region_features_2048"], x["region_boxes"]),
                                      visual_attention_mask=x["region_mask"])
    mlm, itm = model.cls(lang, pooled)
    objects = model.obj_predict_head(visn)
    return {"lxrt.mlm": mlm, "lxrt.itm": itm, "lxrt.image_qa": model.answer_head(pooled),
            "lxrt.mrc": objects["obj"], "lxrt.mrfr": objects["feat"]}


def main() -> None:
    opts = arguments(__doc__, "airsplay/lxmert checkout or archive", "lxmert_original").parse_args()
    reference = opts.reference.resolve()
    record = provenance(reference, opts.commit, REPOSITORY, USED_FILES)
    modeling, vqa_model = import_reference(reference, TINY_LAYERS)
    args = sys.modules["param"].args
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    # tiny models: weights in the reference's file format, and its outputs
    use_bert(modeling, **TINY_BERT)
    set_layers(args, TINY_LAYERS)
    vqa = randomize(build_vqa(modeling, vqa_model, TINY_FEAT_DIM, VQA_ANSWERS), SEED)
    pretraining = randomize(build_pretraining(modeling, QA_ANSWERS), SEED + 1)
    torch.save(vqa.state_dict(), out / "BEST.pth")
    torch.save(pretraining.state_dict(), out / "model_LXRT.pth")
    x = inputs(TINY_BERT["vocab_size_or_config_json_file"])
    tensors = {**x, **vqa_outputs(vqa, x), **pretraining_outputs(pretraining, x)}
    save_tensors(tensors, out / "reference.safetensors")
    (out / "bert_config.json").write_text(vqa.lxrt_encoder.model.config.to_json_string())
    write_vocab(out / "vocab.txt", TINY_BERT["vocab_size_or_config_json_file"])
    label2ans = json.loads((reference / "data/vqa/trainval_label2ans.json").read_text())[:VQA_ANSWERS]
    (out / "label2ans.json").write_text(json.dumps(label2ans))
    all_ans = json.loads((reference / "data/lxmert/all_ans.json").read_text())[:QA_ANSWERS]
    (out / "all_ans.json").write_text(json.dumps(all_ans))

    # full size: the key and shape of every tensor, from modules built without memory
    use_bert(modeling, vocab_size_or_config_json_file=30522)  # bert-base-uncased's bert_config.json
    set_layers(args, FULL_LAYERS)
    with torch.device("meta"):
        full = {"BEST.pth": shapes(build_vqa(modeling, vqa_model, FEAT_DIM, FULL_VQA_ANSWERS)),
                "model_LXRT.pth": shapes(build_pretraining(modeling, FULL_QA_ANSWERS))}
    (out / "manifest_full.json").write_text(json.dumps(full, indent=0) + "\n")

    record |= {"tiny": {"bert": TINY_BERT, "layers": TINY_LAYERS, "vqa_answers": VQA_ANSWERS,
                        "qa_answers": QA_ANSWERS, "vqa_feat_dim": TINY_FEAT_DIM},
               "full": {"layers": FULL_LAYERS, "vqa_answers": FULL_VQA_ANSWERS, "qa_answers": FULL_QA_ANSWERS},
               "torch": torch.__version__, "generator": "scripts/reference_fixtures/lxmert_original.py"}
    write_record(out, record)


if __name__ == "__main__":
    main()
