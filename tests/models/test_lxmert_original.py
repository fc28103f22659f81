"""`vlserve import lxmert`: parity with the original LXMERT code (airsplay/lxmert), its file layouts, and clear errors.

The fixture (tests/fixtures/lxmert_original, see reference.json for the repository and commit) was written by
scripts/reference_fixtures/lxmert_original.py: the reference's own VQAModel and LXRTPretraining at a tiny config with
seeded weights, saved as its code saves them, and their outputs on padded inputs. Imported outputs must equal them
within 1e-5 in fp32.
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models import VLInputs
from models.importers.lxmert_original import BERT_BASE_UNCASED, convert
from tests.models.reference_checks import (
    add, assert_accounted_for, assert_bad_source, drop, full_size_source, halved, import_checkpoint, max_diff,
    record, renamed, resaved, run_import, served_tasks,
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "lxmert_original"
ATOL = 1e-5
BESIDE = ("bert_config.json", "vocab.txt")  # read from beside the weights file
ATTR = ["module.obj_predict_head.decoder_dict.attr.bias", "module.obj_predict_head.decoder_dict.attr.weight"]


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "reference.safetensors")


cli = partial(run_import, "lxmert")
imported = partial(import_checkpoint, "lxmert")


def batch(ref: dict[str, torch.Tensor], features: str) -> VLInputs:
    return VLInputs(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"],
                    token_type_ids=ref["token_type_ids"], region_features=ref[features],
                    region_boxes=ref["region_boxes"], region_mask=ref["region_mask"])


def rewrite(tmp_path: Path, name: str, edit=None, save_kwargs: dict | None = None) -> Path:
    """The fixture's `name` re-saved into tmp_path (after `edit` of its state), with the files read beside it."""
    return resaved(FIXTURE, tmp_path, name, edit, BESIDE, save_kwargs=save_kwargs)


# ---- parity -------------------------------------------------------------------------------------------------


def test_reference_recorded():
    ref = json.loads((FIXTURE / "reference.json").read_text())
    assert ref["repository"] == "airsplay/lxmert" and len(ref["commit"]) == 40
    assert sum(f.stat().st_size for f in FIXTURE.iterdir()) < 2_000_000  # tiny widths keep the fixture small


def test_fine_tuned_vqa_parity(tmp_path, reference):
    """BEST.pth of src/tasks/vqa.py with its answer table: /vqa answers words, outputs equal the reference's."""
    ckpt = imported(FIXTURE / "BEST.pth", tmp_path / "ours", "--answers", FIXTURE / "label2ans.json")
    assert set(ckpt.model.config.heads) == {"vqa"}
    assert ckpt.labels["heads"]["vqa"] == json.loads((FIXTURE / "label2ans.json").read_text())
    assert served_tasks(ckpt)["vqa"].labels == tuple(ckpt.labels["heads"]["vqa"])
    info = record(tmp_path / "ours")
    assert info["format"] == "lxmert" and info["architecture"] == "VQAModel/GQAModel" and info["ignored_keys"] == []
    with torch.no_grad():
        logits = ckpt.model(batch(reference, "region_features"), "vqa").logits
    assert max_diff(logits, reference["best.vqa"]) < ATOL


def test_pretraining_parity(tmp_path, reference):
    """model_LXRT.pth (`module.` keys): every pretraining head; the answer head is image_qa, not served as /vqa."""
    ckpt = imported(FIXTURE / "model_LXRT.pth", tmp_path / "ours", "--answers", FIXTURE / "all_ans.json")
    assert set(ckpt.model.config.heads) == {"mlm", "itm", "mrc", "mrfr", "image_qa"}
    assert ckpt.labels["heads"]["image_qa"] == [a["ans"] for a in json.loads((FIXTURE / "all_ans.json").read_text())]
    assert "vqa" not in served_tasks(ckpt)
    assert record(tmp_path / "ours")["ignored_keys"] == ATTR  # vlserve has no attribute head
    x = batch(reference, "region_features_2048")
    words, regions = x.attention_mask.bool(), x.region_mask.bool()  # padded positions: not outputs
    with torch.no_grad():
        out = {task: ckpt.model(x, task).logits for task in ckpt.model.config.heads}
    assert max_diff(out["mlm"][words], reference["lxrt.mlm"][words]) < ATOL
    assert max_diff(out["mrc"][regions], reference["lxrt.mrc"][regions]) < ATOL
    assert max_diff(out["mrfr"][regions], reference["lxrt.mrfr"][regions]) < ATOL
    for task in ("itm", "image_qa"):
        assert max_diff(out[task], reference[f"lxrt.{task}"]) < ATOL


LAYOUTS = {  # other ways the reference saves the same tensors
    "BEST.pth fine-tuned with --multiGPU": ("BEST.pth", renamed("lxrt_encoder.model.", "lxrt_encoder.model.module."), {}),
    "_LXRT.pth on one GPU": ("model_LXRT.pth", renamed("module.", ""), {}),
    "BEST.pth in torch's legacy format": ("BEST.pth", None, {"_use_new_zipfile_serialization": False}),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_other_layouts_import_alike(case, tmp_path, reference):
    name, edit, save_kwargs = LAYOUTS[case]
    ckpt = imported(rewrite(tmp_path, name, edit, save_kwargs), tmp_path / "ours")
    task, features = ("vqa", "region_features") if name == "BEST.pth" else ("itm", "region_features_2048")
    with torch.no_grad():
        logits = ckpt.model(batch(reference, features), task).logits
    assert max_diff(logits, reference[f"{'best' if name == 'BEST.pth' else 'lxrt'}.{task}"]) < ATOL


@pytest.mark.parametrize("name", ["BEST.pth", "model_LXRT.pth"])
def test_full_size_keys_all_accounted_for(name):
    """A state dict of the reference's full-size key set (zero-stride zeros: no memory) maps onto BERT-base-sized
    lxmert with nothing missing, left over or mis-shaped."""
    shapes = json.loads((FIXTURE / "manifest_full.json").read_text())[name]
    source = full_size_source(FIXTURE, shapes, name, dict(BERT_BASE_UNCASED))
    config, weights, labels, _ = convert(source)
    assert config.encoder.size == "base"  # 768 wide, 9 language, 5 object-relationship, 5 cross-modality layers
    assert_accounted_for(source, config, weights)
    assert source.ignored() == ([] if name == "BEST.pth" else ATTR)
    answers = {"BEST.pth": ("vqa", 3129), "model_LXRT.pth": ("image_qa", 9500)}[name]
    assert config.heads[answers[0]].num_labels == answers[1]


# ---- errors: exit code 2, one line naming the file, no traceback --------------------------------------------


def truncated(tmp_path):
    return halved(rewrite(tmp_path, "BEST.pth"))


def pickled_object(tmp_path):
    return rewrite(tmp_path, "BEST.pth", lambda sd: {**sd, "args": Path("snap/vqa")})  # weights_only refuses it


def training_state(tmp_path):
    return rewrite(tmp_path, "BEST.pth", lambda sd: {"epoch": 3, "model": sd})


def nlvr2(sd):
    h = sd["logit_fc.0.weight"].shape[1]
    return {**sd, "logit_fc.0.weight": torch.zeros(2 * h, 2 * h), "logit_fc.0.bias": torch.zeros(2 * h),
            "logit_fc.2.weight": torch.ones(2 * h), "logit_fc.2.bias": torch.zeros(2 * h),
            "logit_fc.3.weight": torch.zeros(2, 2 * h), "logit_fc.3.bias": torch.zeros(2)}


def without_bert_config(tmp_path):
    src = rewrite(tmp_path, "BEST.pth")
    (src.parent / "bert_config.json").unlink()
    return src


def bert_config(**changes):
    """BEST.pth beside a bert_config.json with `changes`."""
    config = json.loads((FIXTURE / "bert_config.json").read_text()) | changes
    return lambda tmp: resaved(FIXTURE, tmp, "BEST.pth", copied=BESIDE, written={"bert_config.json": json.dumps(config)})


def answers(table):
    def make(tmp_path):
        (tmp_path / "answers.json").write_text(json.dumps(table))
        return rewrite(tmp_path, "BEST.pth")
    return make


def downloaded(text: str):
    """BEST.pth, beside its files, holding `text`: what a broken download leaves."""
    def make(tmp_path):
        src = rewrite(tmp_path, "BEST.pth")
        src.write_text(text)
        return src
    return make


KEY = "module.bert.encoder.layer.1.attention.self.key.weight"
WORDS = "lxrt_encoder.model.bert.embeddings.word_embeddings.weight"
ERRORS = {
    "directory": (lambda tmp: FIXTURE, "a directory; give the .pth file (snap/vqa/BEST.pth, model_LXRT.pth)"),
    "no file": (lambda tmp: tmp / "BEST.pth", "BEST.pth: no such file"),
    "truncated file": (truncated, "BEST.pth: unreadable weights, truncated or corrupt"),
    "pickled object": (pickled_object, "BEST.pth: unreadable weights: the pickle holds pathlib.PosixPath"),
    "not a tensor dictionary": (training_state, "BEST.pth: not a state dict"),
    "missing tensor": (lambda tmp: rewrite(tmp, "model_LXRT.pth", drop("module.bert.encoder.x_layers.1.visn_output.LayerNorm.bias")),
                       "model_LXRT.pth: source checkpoint lacks module.bert.encoder.x_layers.1.visn_output.LayerNorm.bias"),
    "extra tensor": (lambda tmp: rewrite(tmp, "model_LXRT.pth", add("module.bert.encoder.adapter.weight", torch.zeros(2))),
                     "model_LXRT.pth: unexpected tensor module.bert.encoder.adapter.weight"),
    "wrong shape": (lambda tmp: rewrite(tmp, "model_LXRT.pth", add(KEY, torch.zeros(8, 16))),
                    f"model_LXRT.pth: tensor {KEY} has shape (8, 16), the model needs (16, 16)"),
    "unfusable shape": (lambda tmp: rewrite(tmp, "model_LXRT.pth", add(KEY, torch.zeros(16, 8))),
                        f"model_LXRT.pth: tensor {KEY} has shape (16, 8), which cannot be fused"),
    "transformers format": (lambda tmp: rewrite(tmp, "BEST.pth", renamed("lxrt_encoder.model.bert.", "lxmert.")),
                            "BEST.pth: transformers' LXMERT weights: import their directory with `vlserve import hf-lxmert`"),
    "another model": (lambda tmp: rewrite(tmp, "BEST.pth", lambda sd: {"backbone.conv1.weight": torch.zeros(2)}),
                      "BEST.pth: not an airsplay/lxmert checkpoint"),
    "nlvr2 model": (lambda tmp: rewrite(tmp, "BEST.pth", nlvr2), "BEST.pth: logit_fc reads 32 values, not the pooled 16"),
    "tiny without bert_config.json": (without_bert_config, "BEST.pth: hidden size 16, not bert-base-uncased's 768"),
    "bert_config.json without heads": (bert_config(num_attention_heads=0), "bert_config.json: num_heads=0 must be at least 1"),
    "bert_config.json dropout above 1": (bert_config(hidden_dropout_prob=5),
                                         "bert_config.json: dropout=5.0 is not a probability in [0, 1]"),
    "answers of another size": (answers(["yes", "no"]), "answers.json: 2 answers, but the checkpoint's vqa head has 7"),
    "not an answer table": (answers({"yes": "no"}), "answers.json: not an answer table"),
    "ans2label with gaps": (answers({"yes": 0, "no": 2}), "answers.json: the answer -> index object's indices"),
    "Git LFS pointer": (downloaded("version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 913000000\n"),
                        "BEST.pth: not a PyTorch weights file but a Git LFS pointer to one: fetch the weights with "
                        "`git lfs pull`"),
    "HTML page": (downloaded("<!DOCTYPE html><html><body>Access denied</body></html>\n"),
                  "BEST.pth: not a PyTorch weights file: it looks like an HTML page (a failed download"),
    "1-d word embeddings": (lambda tmp: rewrite(tmp, "BEST.pth", lambda sd: {**sd, WORDS: sd[WORDS].flatten()}),
                            f"BEST.pth: tensor {WORDS} has shape (", "), expected a 2-d tensor"),
    "0-d answer classifier": (lambda tmp: rewrite(tmp, "BEST.pth", add("logit_fc.0.weight", torch.tensor(0.5))),
                              "BEST.pth: tensor logit_fc.0.weight has shape (), expected a 2-d tensor"),
    "infinite weights": (lambda tmp: rewrite(tmp, "model_LXRT.pth", lambda sd: {**sd, KEY: torch.full_like(sd[KEY], float("inf"))}),
                         f"model_LXRT.pth: tensor {KEY} holds 256 NaN or infinite values"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_source_exits_2_with_one_clear_message(case, tmp_path):
    assert_bad_source(cli, tmp_path, *ERRORS[case])


def test_ans2label_names_answers_by_index(tmp_path):
    names = json.loads((FIXTURE / "label2ans.json").read_text())
    (tmp_path / "ans2label.json").write_text(json.dumps({a: i for i, a in reversed(list(enumerate(names)))}))
    ckpt = imported(FIXTURE / "BEST.pth", tmp_path / "ours", "--answers", tmp_path / "ans2label.json")
    assert ckpt.labels["heads"]["vqa"] == names


def test_numbered_answers_warn(tmp_path):
    result = cli(FIXTURE / "BEST.pth", tmp_path / "ours")
    assert result.exit_code == 0, result.output
    assert "warning: the 7 VQA answers are numbered; pass --answers FILE" in result.stderr
