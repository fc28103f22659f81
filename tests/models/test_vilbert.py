"""`vlserve import vilbert`: parity with facebookresearch/vilbert-multi-task's ViLBERT, its full-size key set, errors.

The fixture (tests/fixtures/vilbert, see reference.json for the repository and commit) was written by
scripts/reference_fixtures/vilbert.py: the reference's own BertForMultiModalPreTraining and VILBertForVLTasks (with
task tokens, as the 12-in-1 model) at tiny configs with seeded weights, saved as its code saves them, and their outputs
at two padded shapes. Imported outputs must equal them within 1e-5 in fp32.
"""
from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from models import ModelConfig, VLInputs, VLModel
from models.checkpoint import load_checkpoint
from models.importers.vilbert import TASK_TOKENS, convert
from service.pipeline import task_specs
from tests.models.reference_checks import (
    assert_one_line_error, full_size_source, halved, max_diff, record, resaved, run_import,
)
from vlserve.cli import app

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vilbert"
ATOL = 1e-5
SHAPES = ("a", "b")  # the generator's two padded shapes
CONFIGS = {"pretrained_model.bin": "pretrained_config.json", "multi_task_model.bin": "multi_task_config.json"}
INPUTS = ("input_ids", "attention_mask", "token_type_ids", "region_features", "region_boxes", "region_mask")


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "reference.safetensors")


cli = partial(run_import, "vilbert")


def imported(name: str, out: Path, *options: str | Path):
    result = cli(FIXTURE / name, out, "--config", FIXTURE / CONFIGS[name], *options)
    assert result.exit_code == 0, result.output
    return load_checkpoint(out), result


def batch(ref: dict[str, torch.Tensor], shape: str, pairs: bool = False) -> VLInputs:
    """One of the generator's batches; `pairs`: NLVR2's, each even row's text with the regions of rows 2i and 2i+1."""
    x = {k: ref[f"{shape}.{k}"] for k in INPUTS}
    if pairs:
        x |= {k: x[k][0::2] for k in INPUTS[:3]}
        x |= {k: x[k].reshape(x[k].shape[0] // 2, 2, *x[k].shape[1:]) for k in INPUTS[3:]}
    return VLInputs(**x)


def q_dense(layers: int) -> list[str]:
    return [f"bert.encoder.c_layer.{k}.biOutput.q_dense{s}.{t}" for k in range(layers) for s in (1, 2)
            for t in ("weight", "bias")]


# ---- parity -------------------------------------------------------------------------------------------------


def test_reference_recorded():
    ref = json.loads((FIXTURE / "reference.json").read_text())
    assert ref["repository"] == "facebookresearch/vilbert-multi-task" and len(ref["commit"]) == 40
    assert "vilbert/vilbert.py" in ref["sha256"]
    assert sum(f.stat().st_size for f in FIXTURE.iterdir()) < 3_000_000  # tiny widths keep the fixture small


def test_pretrained_parity(tmp_path, reference):
    """pretrained_model.bin: masked LM, masked region classification (regions after [IMG]) and ITM (its index 0 is
    "matches", ours 1), at both padded shapes; q_dense* are listed as never used."""
    ckpt, result = imported("pretrained_model.bin", tmp_path / "ours")
    assert set(ckpt.model.config.heads) == {"mlm", "itm", "mrc"}
    info = record(tmp_path / "ours")
    assert info["architecture"] == "BertForMultiModalPreTraining" and info["ignored_keys"] == sorted(q_dense(2))
    assert "warning: 8 source tensors not imported" in result.stderr
    enc = ckpt.model.config.encoder
    assert enc.coattention_image_layers == (0, 2) and enc.coattention_text_layers == (1, 1) and enc.task_tokens == 0
    model = ckpt.model.eval()
    for shape in SHAPES:
        x = batch(reference, shape)
        words, regions = x.attention_mask.bool(), x.region_mask.bool()  # padded positions: not outputs
        with torch.no_grad():
            out = {task: model(x, task).logits for task in ("mlm", "mrc", "itm")}
        assert max_diff(out["mlm"][words], reference[f"{shape}.pretrained.mlm"][words]) < ATOL
        assert max_diff(out["mrc"][regions], reference[f"{shape}.pretrained.mrc"][:, 1:][regions]) < ATOL
        assert max_diff(out["itm"], reference[f"{shape}.pretrained.itm"].flip(-1)) < ATOL


def test_multi_task_parity(tmp_path, reference):
    """multi_task_model.bin (12-in-1, task tokens): every head with an endpoint, each run with its task's token, at
    both padded shapes; NLVR2 on image pairs."""
    answers = [f"answer{i}" for i in range(3129)]
    (tmp_path / "label2ans.json").write_text(json.dumps(answers))
    ckpt, result = imported("multi_task_model.bin", tmp_path / "ours", "--answers", tmp_path / "label2ans.json")
    heads = ckpt.model.config.heads
    assert {name: (h.kind, h.task_token) for name, h in heads.items()} == {
        "vqa": ("vqa", 1), "gqa": ("vqa", 15), "nlvr2": ("nlvr2", 12), "refer": ("refer", 9), "rank": ("itm", 7)}
    assert {name: h.task_token for name, h in heads.items()} == TASK_TOKENS
    assert ckpt.labels["heads"]["vqa"] == answers
    specs = task_specs({t: h.kind for t, h in heads.items()}, {}, ckpt.labels)
    assert {kind: spec.task for kind, spec in specs.items()} == {"vqa": "vqa", "nlvr2": "nlvr2", "refer": "refer",
                                                                 "itm": "rank"}
    ignored = record(tmp_path / "ours")["ignored_keys"]
    assert {"vil_tri_prediction.weight", "linguisic_logit.weight", "cls.bi_seq_relationship.weight",
            "cls.predictions.decoder.weight", *q_dense(2)} <= set(ignored)
    assert all(k.startswith(("vil_tri_prediction.", "linguisic_logit.", "cls.")) or k in q_dense(2) for k in ignored)
    assert "vil_tri_prediction" in result.stderr
    assert ckpt.model.config.encoder.img_from_regions
    model = ckpt.model.eval()
    for shape in SHAPES:
        x = batch(reference, shape)
        # a detector's whole-image feature is not [IMG]: vilbert-multi-task's is the mean of the regions' features
        x = x.replace(image_feature=torch.randn(x.region_features.shape[0], x.region_features.shape[-1]))
        regions = x.region_mask.bool()
        with torch.no_grad():
            out = {task: model(x, task).logits for task in ("vqa", "gqa", "rank", "refer")}
            nlvr2 = model(batch(reference, shape, pairs=True), "nlvr2").logits
        assert max_diff(out["vqa"], reference[f"{shape}.task1.vil_prediction"]) < ATOL
        assert max_diff(out["gqa"], reference[f"{shape}.task15.vil_prediction_gqa"]) < ATOL
        assert max_diff(out["rank"][:, 1] - out["rank"][:, 0], reference[f"{shape}.task7.vil_logit"][:, 0]) < ATOL
        refer = reference[f"{shape}.task9.vision_logit"][:, 1:, 0]  # after [IMG]
        assert max_diff(out["refer"][regions], refer[regions]) < ATOL
        assert max_diff(nlvr2, reference[f"{shape}.task12.vil_binary_prediction"]) < ATOL


def test_task_token_is_required_and_changes_the_answer(tmp_path, reference):
    ckpt, _ = imported("multi_task_model.bin", tmp_path / "ours")
    model, x = ckpt.model.eval(), batch(reference, "a")
    with torch.no_grad():
        with pytest.raises(ValueError, match="puts a task token after \\[CLS\\]"):
            model.forward_features(x)
        vqa = model.heads["vqa"](model.forward_features(x, task_token=1), x)
        other = model.heads["vqa"](model.forward_features(x, task_token=2), x)
    assert max_diff(vqa, reference["a.task1.vil_prediction"]) < ATOL and max_diff(vqa, other) > 1e-3


def test_another_task_of_a_head_is_chosen_at_import(tmp_path, reference):
    """`--task-token HEAD=ID` runs a head with another 12-in-1 task (editing config.json instead breaks its hash)."""
    ckpt, _ = imported("multi_task_model.bin", tmp_path / "ours", "--task-token", "refer=10", "--task-token", "rank=8")
    model, x = ckpt.model.eval(), batch(reference, "a")
    assert {name: h.task_token for name, h in model.config.heads.items()} == {**TASK_TOKENS, "refer": 10, "rank": 8}
    with torch.no_grad():
        refer = model(x, "refer").logits
        assert max_diff(refer, model.heads["refer"](model.forward_features(x, task_token=10), x)) == 0
        assert max_diff(refer, model.heads["refer"](model.forward_features(x, task_token=9), x)) > 1e-4


@pytest.mark.parametrize("name,given,message", [
    ("multi_task_model.bin", "refer", "give HEAD=ID, e.g. refer=10"),
    ("multi_task_model.bin", "refer=ten", "give HEAD=ID, e.g. refer=10"),
    ("multi_task_model.bin", "caption=3", "no head 'caption'; the heads are gqa, nlvr2, rank, refer, vqa"),
    ("multi_task_model.bin", "refer=999", "the model's task ids are 0 to"),
    ("pretrained_model.bin", "refer=10", "this model has no task"),
])
def test_a_task_token_that_cannot_be_is_refused(tmp_path, name, given, message):
    result = cli(FIXTURE / name, tmp_path / "ours", "--config", FIXTURE / CONFIGS[name], "--task-token", given)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "ours").exists()


def test_a_head_without_a_task_token_on_a_task_token_model_is_refused(tmp_path):
    """Its inputs would carry no task (the forward failed at serve's warm-up with "got None")."""
    ckpt, _ = imported("multi_task_model.bin", tmp_path / "ours")
    data = ckpt.model.config.to_dict()
    data["heads"]["refer"]["task_token"] = -1
    with pytest.raises(ValueError, match="head 'refer': task_token=-1, but every head of an encoder with task tokens"):
        ModelConfig.from_dict(data)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_size_keys_all_accounted_for(name):
    """A state dict of the reference's full-size key set (zero-stride zeros: no memory) with
    bert_base_6layer_6conect.json maps onto BERT-base-sized vilbert with nothing missing, left over or mis-shaped."""
    full = json.loads((FIXTURE / "manifest_full.json").read_text())
    source = full_size_source(FIXTURE, full[name], name, full["config"])
    config, weights, labels, _ = convert(source)
    enc = config.encoder
    assert enc.size == "base" and (enc.image_width, enc.image_heads, enc.coattention_width) == (1024, 8, 1024)
    assert enc.coattention_text_layers == (6, 7, 8, 9, 10, 11) and enc.coattention_image_layers == (0, 1, 2, 3, 4, 5)
    with torch.device("meta"):
        own = VLModel(config).state_dict()
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in own.items()}
    ignored = source.ignored()
    if name == "pretrained_model.bin":
        assert ignored == sorted(q_dense(6)) and config.heads["mrc"].num_labels == 1601
    else:
        assert set(q_dense(6)) <= set(ignored) and enc.task_tokens == 20
        assert (config.heads["vqa"].num_labels, config.heads["gqa"].num_labels) == (3129, 1533)


# ---- errors: exit code 2, one line naming the file, no traceback --------------------------------------------


def rewrite(tmp_path: Path, name: str = "multi_task_model.bin", edit=None, config_edit=None) -> Path:
    """The fixture's `name` re-saved into tmp_path (after `edit` of its state) with its config as config.json."""
    config = json.loads((FIXTURE / CONFIGS[name]).read_text())
    written = {"config.json": json.dumps(config_edit(config) if config_edit else config)}
    return resaved(FIXTURE, tmp_path, name, edit, ("vocab.txt",), written)


def truncated(tmp_path):
    return halved(rewrite(tmp_path))


def other_format(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(FIXTURE.parent / "lxmert_original" / "BEST.pth", src / "BEST.pth")
    shutil.copy(FIXTURE / "multi_task_config.json", src / "config.json")
    return src / "BEST.pth"


def without_config(tmp_path):
    src = rewrite(tmp_path)
    (src.parent / "config.json").unlink()
    return src


def setting(**fields):
    return lambda tmp: rewrite(tmp, config_edit=lambda c: {**c, **fields})


def drop(key: str):
    return lambda tmp: rewrite(tmp, edit=lambda sd: {k: v for k, v in sd.items() if k != key})


def add(key: str, value: torch.Tensor):
    return lambda tmp: rewrite(tmp, edit=lambda sd: {**sd, key: value})


HINT = "config.json and the weights disagree?"
ERRORS = {
    "directory": (lambda tmp: FIXTURE, "a directory; give the .bin file"),
    "no file": (lambda tmp: tmp / "multi_task_model.bin", "multi_task_model.bin: no such file"),
    "truncated file": (truncated, "multi_task_model.bin: unreadable weights, truncated or corrupt"),
    "pickled object": (lambda tmp: rewrite(tmp, edit=lambda sd: {**sd, "args": Path("save")}),
                       "unreadable weights: the pickle holds pathlib.PosixPath"),
    "training state": (lambda tmp: rewrite(tmp, edit=lambda sd: {"model_state_dict": sd, "epoch": 3}),
                       "multi_task_model.bin: not a state dict"),
    "lxmert checkpoint": (other_format, "BEST.pth: an airsplay/lxmert fine-tuned model: import it with `vlserve import lxmert`"),
    "another model": (lambda tmp: rewrite(tmp, edit=lambda sd: {"backbone.conv1.weight": torch.zeros(2)}),
                      "multi_task_model.bin: not a vilbert-multi-task checkpoint"),
    "no config": (without_config, "no ViLBERT config beside it"),
    "config wider than the weights": (setting(v_hidden_size=1024, v_num_attention_heads=8),
                                      "tensor bert.v_embeddings.image_embeddings.weight has shape (24, 2048), the model "
                                      "needs (1024, 2048)", HINT),
    "config with more layers": (setting(num_hidden_layers=5, t_biattention_id=[5, 5]),
                                "config.json: num_hidden_layers is 5, but the weights have 4 (bert.encoder.layer.*)"),
    "config with fewer image layers": (setting(v_num_hidden_layers=1, v_biattention_id=[0, 1]),
                                       "config.json: v_num_hidden_layers is 1, but the weights have 2 (bert.encoder.v_layer.*)"),
    "config with a billion layers": (setting(num_hidden_layers=10**9),  # refused before any layer is built
                                     "config.json: num_hidden_layers is 1000000000, but the weights have 4 (bert.encoder.layer.*)"),
    "config without image-stream heads": (setting(v_num_attention_heads=0),
                                          "config.json: field 'v_num_attention_heads' is 0, expected at least 1"),
    "co-attention heads that do not divide": (setting(bi_num_attention_heads=3),
                                              "config.json: coattention_hidden_size=16 is not a multiple of its number of heads (3)"),
    "config with fewer co-attention layers": (setting(v_biattention_id=[0], t_biattention_id=[4]),
                                              "unexpected tensor bert.encoder.c_layer.1.", HINT),
    "sum pooling": (setting(fusion_method="sum"), "config.json: fusion_method 'sum' is not supported"),
    "missing tensor": (drop("bert.encoder.c_layer.1.biattention.key2.bias"),
                       "source checkpoint lacks bert.encoder.c_layer.1.biattention.key2.bias"),
    "extra tensor": (add("bert.encoder.adapter.weight", torch.zeros(2)), "unexpected tensor bert.encoder.adapter.weight"),
    "negative text layer id": (setting(t_biattention_id=[-1, 3]),  # the reference would run layer[:-1] first
                               "config.json: field 't_biattention_id' is [-1, 3], expected a list of layer indices "
                               "from 0 to 4"),
    "image layer id past the image layers": (setting(v_biattention_id=[0, 3]),
                                             "config.json: field 'v_biattention_id' is [0, 3], expected a list of "
                                             "layer indices from 0 to 2"),
    "0-d ITM classifier": (lambda tmp: rewrite(tmp, "pretrained_model.bin", lambda sd: {
                               **sd, "cls.bi_seq_relationship.weight": torch.tensor(0.5)}),
                           "pretrained_model.bin: tensor cls.bi_seq_relationship.weight has shape (), expected a 2-d "
                           "tensor"),
    "integer ITM bias": (lambda tmp: rewrite(tmp, "pretrained_model.bin", lambda sd: {
                             **sd, "cls.bi_seq_relationship.bias": torch.ones(2, dtype=torch.int64)}),
                         "pretrained_model.bin: tensor cls.bi_seq_relationship.bias is int64, not floating point"),
    "0-d retrieval score bias": (add("vil_logit.bias", torch.tensor(0.5)),
                                 "multi_task_model.bin: tensor vil_logit.bias has shape (), expected a 1-d tensor"),
    "NaN retrieval score": (add("vil_logit.weight", torch.full((1, 16), float("nan"))),
                            "multi_task_model.bin: tensor vil_logit.weight holds 16 NaN or infinite values"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_source_exits_2_with_one_clear_message(case, tmp_path):
    make, *messages = ERRORS[case]
    src = make(tmp_path)
    assert_one_line_error(cli(src, tmp_path / "out"), tmp_path / "out", *messages)


def test_vilbert_file_given_to_the_lxmert_importer_says_which_importer_reads_it(tmp_path):
    """Both save BERT under `bert.`: the LXMERT importer names this format instead of misreading it."""
    result = CliRunner().invoke(app, ["import", "lxmert", str(FIXTURE / "pretrained_model.bin"), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "pretrained_model.bin: a vilbert-multi-task checkpoint" in result.stderr
    assert "`vlserve import vilbert`" in result.stderr


def test_task_token_is_not_a_word_of_the_outputs(tmp_path, reference):
    """Text states and attentions (what explain=true shows) have one row per input token: the task token is dropped."""
    ckpt, _ = imported("multi_task_model.bin", tmp_path / "ours")
    x = batch(reference, "a")
    with torch.no_grad():
        enc = ckpt.model.eval().forward_features(x, output_attentions=True, task_token=1)
    b, t = x.input_ids.shape
    assert enc.text.shape[:2] == (b, t)
    assert all(a.shape[-2:] == (t, t) for a in enc.attentions)
    assert all(a.shape[-2:] == (t, x.region_features.shape[1]) for a in enc.cross_attentions)

