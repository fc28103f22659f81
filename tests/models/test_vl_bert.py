"""`vlserve import vl-bert`: parity with VL-BERT's own code (jackroos/VL-BERT), its file layouts, and clear errors.

The fixture (tests/fixtures/vl_bert, see reference.json for the repository and commit) was written by
scripts/reference_fixtures/vl_bert.py: the reference's VQA, RefCOCO+ and pretraining task modules at a tiny config
with seeded weights, saved as its training saves them, and their hidden states and head outputs on two padded input
shapes. Imported outputs must equal them within 1e-5 in fp32.

The reference lays its sequence out packed, [text][image][regions][END] then padding, row by row; vlserve pads each
part: [text (T)][regions (N)][image][END]. Hidden states are compared token by token at the real positions.
"""
from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from models import EncoderConfig, HeadConfig, ModelConfig, VLInputs, VLModel, encoder_config
from models.checkpoint import load_checkpoint
from models.importers.vl_bert import UNUSED, convert
from models.tokenizer import VLTokenizer
from service.pipeline import task_specs
from tests.models.reference_checks import (
    assert_accounted_for, assert_bad_source, full_size_source, halved, max_diff, resaved, run_import,
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vl_bert"
ATOL = 1e-5
SHAPES = ("a", "b")  # the generator's two input shapes (batch, text and region padding differ)
MODELS = {"vqa": "vqa", "refcoco": "refer", "pretrain": "mlm"}  # fixture model -> a head it has


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "reference.safetensors")


cli = partial(run_import, "vl-bert")


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict:
    """Each fixture model imported once with the CLI (the VQA model with its answers)."""
    root = tmp_path_factory.mktemp("vl_bert")
    out = {}
    for name in MODELS:
        options = ["--answers", FIXTURE / "answers_vqa.txt"] if name == "vqa" else []
        result = cli(FIXTURE / f"{name}.model", root / name, *options)
        assert result.exit_code == 0, result.output
        out[name] = load_checkpoint(root / name)
    return out


def batch(ref: dict[str, torch.Tensor], shape: str, name: str) -> VLInputs:
    """The reference's text (as its task module built it) and regions, as vlserve's service feeds them: boxes
    normalized by the image size; image "b" leaves the image feature out (both sides take the regions' mean)."""
    g = lambda key: ref[f"{shape}.{key}"]  # noqa: E731
    wh = g("image_wh").repeat(1, 2)[:, None]  # (B, 1, 4) w, h, w, h
    return VLInputs(input_ids=g(f"{name}.text_input_ids"), attention_mask=g(f"{name}.text_mask"),
                    token_type_ids=g(f"{name}.text_token_type_ids"), region_features=g("region_features"),
                    region_boxes=g("boxes") / wh, region_mask=g("region_mask"),
                    image_feature=g("image_feature") if shape == "a" else None)


def packed(sequence: torch.Tensor, x: VLInputs) -> list[torch.Tensor]:
    """Our sequence's real tokens per row in the reference's order: text, image, regions, [END]."""
    t, n = x.input_ids.shape[1], x.region_features.shape[1]
    rows = []
    for i in range(sequence.shape[0]):
        words, regions = int(x.attention_mask[i].sum()), int(x.region_mask[i].sum())
        rows.append(torch.cat([sequence[i, :words], sequence[i, t + n : t + n + 1], sequence[i, t : t + regions],
                               sequence[i, t + n + 1 :]]))
    return rows


# ---- parity -------------------------------------------------------------------------------------------------


def test_reference_recorded():
    ref = json.loads((FIXTURE / "reference.json").read_text())
    assert ref["repository"] == "jackroos/VL-BERT" and len(ref["commit"]) == 40
    assert all(len(h) == 64 for h in ref["sha256"].values())
    assert all(f.stat().st_size < 5_000_000 for f in FIXTURE.iterdir())
    assert sum(f.stat().st_size for f in FIXTURE.iterdir()) < 3_000_000


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(MODELS))
def test_hidden_states_equal_the_reference(name, shape, imported, reference):
    """Every real token's last hidden state (text, the whole-image token, regions, [END])."""
    model = imported[name].model
    x = batch(reference, shape, name)
    with torch.no_grad():
        enc = model.forward_features(x)
    theirs = reference[f"{shape}.{name}.hidden"]
    for i, ours in enumerate(packed(enc.sequence, x)):
        assert max_diff(ours, theirs[i, : len(ours)]) < ATOL


@pytest.mark.parametrize("shape", SHAPES)
def test_vqa_answer_slot_equals_the_reference(shape, imported, reference):
    ckpt = imported["vqa"]
    head = ckpt.model.config.heads["vqa"]
    assert (head.pool, head.classifier, head.num_labels) == ("answer_segment", "bert", 7)
    with torch.no_grad():
        logits = ckpt.model(batch(reference, shape, "vqa"), "vqa").logits
    assert max_diff(logits, reference[f"{shape}.vqa.vqa"]) < ATOL


@pytest.mark.parametrize("shape", SHAPES)
def test_refer_scores_equal_the_reference(shape, imported, reference):
    """A score per detector region; the reference also scores its whole-image region 0, which vlserve does not serve."""
    x = batch(reference, shape, "refcoco")
    with torch.no_grad():
        logits = imported["refcoco"].model(x, "refer").logits
    real = x.region_mask.bool()
    theirs = reference[f"{shape}.refcoco.refer"][:, 1 : 1 + x.region_mask.shape[1]]
    assert max_diff(logits[real], theirs[real]) < ATOL


@pytest.mark.parametrize("shape", SHAPES)
def test_pretraining_heads_equal_the_reference(shape, imported, reference):
    ckpt = imported["pretrain"]
    assert set(ckpt.model.config.heads) == {"mlm", "mrc"}
    x = batch(reference, shape, "pretrain")
    with torch.no_grad():
        mlm = ckpt.model(x, "mlm").logits
        mrc = ckpt.model(x, "mrc").logits
    words, regions = x.attention_mask.bool(), x.region_mask.bool()
    assert max_diff(mlm[words], reference[f"{shape}.pretrain.mlm"][words]) < ATOL
    theirs = reference[f"{shape}.pretrain.mrc"][:, 1 : 1 + regions.shape[1]]
    assert max_diff(mrc[regions], theirs[regions]) < ATOL


def test_the_tokenizer_lays_out_the_vqa_text_as_the_reference(imported, reference):
    """What the service sends for a question is the text the reference's VQA module builds: [CLS] q [SEP] [MASK] [SEP]
    with the last two in segment 1."""
    ckpt = imported["vqa"]
    spec = task_specs({"vqa": "vqa"}, ckpt.model.config.heads, ckpt.labels)["vqa"]  # the layout the head declares
    tok: VLTokenizer = ckpt.tokenizer
    names = {i: w for w, i in tok.vocab.items()}
    for shape in SHAPES:
        words = reference[f"{shape}.words"]
        questions = [" ".join(names[int(i)] for i in row if i > 0) for row in words]
        ours = tok.encode(questions, answer_slot=spec.answer_slot)
        assert (torch.from_numpy(ours["input_ids"]) == reference[f"{shape}.vqa.text_input_ids"]).all()
        assert (torch.from_numpy(ours["token_type_ids"]) == reference[f"{shape}.vqa.text_token_type_ids"]).all()


def test_served_heads(imported):
    vqa, refer, pretrain = (imported[n] for n in MODELS)
    answers = (FIXTURE / "answers_vqa.txt").read_text().split()
    specs = task_specs({"vqa": "vqa"}, vqa.model.config.heads, vqa.labels)
    assert specs["vqa"].labels == tuple(answers) and specs["vqa"].answer_slot == "answer_segment"
    assert set(task_specs({"refer": "refer"}, {}, refer.labels)) == {"refer"}
    assert not task_specs({t: h.kind for t, h in pretrain.model.config.heads.items()}, {}, pretrain.labels)


def test_answer_list_with_a_byte_order_mark(imported, tmp_path):
    """answers_vqa.txt saved with a UTF-8 byte-order mark (as Windows editors write) names the answers the same."""
    (tmp_path / "answers.txt").write_bytes(b"\xef\xbb\xbf" + (FIXTURE / "answers_vqa.txt").read_bytes())
    result = cli(FIXTURE / "vqa.model", tmp_path / "out", "--answers", tmp_path / "answers.txt")
    assert result.exit_code == 0, result.output
    assert load_checkpoint(tmp_path / "out").labels == imported["vqa"].labels


def test_released_configs_have_no_pooler(imported):
    for ckpt in imported.values():
        assert ckpt.model.encoder.pooler is None and not ckpt.model.config.encoder.pooler
        assert ckpt.model.config.encoder.vlbert_embedding == "reference"


# ---- layouts ------------------------------------------------------------------------------------------------


def rewrite(tmp_path: Path, name: str, edit=None, save_kwargs: dict | None = None, yaml_edit=None) -> Path:
    """The fixture's `name` re-saved into tmp_path (after `edit` of the whole file), with its yaml and vocab.txt."""
    config_file = Path(name).with_suffix(".yaml").name
    config = yaml.safe_load((FIXTURE / config_file).read_text())
    written = {config_file: yaml.safe_dump(yaml_edit(config) if yaml_edit else config)}
    return resaved(FIXTURE, tmp_path, name, edit, ("vocab.txt",), written, save_kwargs)


def in_state(fn):
    return lambda data: {**data, "state_dict": fn(data["state_dict"])}


def renamed(old: str, new: str):
    return in_state(lambda sd: {(new + k[len(old):] if k.startswith(old) else k): v for k, v in sd.items()})


LAYOUTS = {
    "bare state dict on one GPU": (lambda data: {k[len("module."):]: v for k, v in data["state_dict"].items()}, {}),
    "with its optimizer state": (lambda data: {**data, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-7}]}}, {}),
    "torch's legacy format": (None, {"_use_new_zipfile_serialization": False}),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_other_layouts_import_alike(case, tmp_path, reference):
    edit, save_kwargs = LAYOUTS[case]
    result = cli(rewrite(tmp_path, "vqa.model", edit, save_kwargs), tmp_path / "ours")
    assert result.exit_code == 0, result.output
    with torch.no_grad():
        logits = load_checkpoint(tmp_path / "ours").model(batch(reference, "a", "vqa"), "vqa").logits
    assert max_diff(logits, reference["a.vqa.vqa"]) < ATOL


@pytest.mark.parametrize("name", ["vl-bert-base-e2e.model", "vl-bert-base-prec.model", "vqa-base.model",
                                  "refcoco+-base.model"])
def test_full_size_keys_all_accounted_for(name):
    """A state dict of the reference's full-size key set (zero-stride zeros: no memory) maps onto BERT-base-sized
    vl-bert with nothing missing, left over or mis-shaped; what is not imported is only what UNUSED names."""
    shapes = json.loads((FIXTURE / "manifest_full.json").read_text())[name]
    source = full_size_source(FIXTURE, shapes, name, {})
    config, weights, labels, _ = convert(source)
    assert config.encoder.size == "base" and config.encoder.visual_feat_dim == 2048 and not config.encoder.pooler
    assert config.encoder == encoder_config("vl-bert", "base")  # the preset builds the reference's model
    assert_accounted_for(source, config, weights)
    assert all(key.startswith(tuple(f"module.{p}" for p in UNUSED)) for key in source.ignored())
    heads = {"vl-bert-base-e2e.model": {"mlm", "mrc"}, "vl-bert-base-prec.model": {"mlm", "mrc"},
             "vqa-base.model": {"vqa"}, "refcoco+-base.model": {"refer"}}[name]
    assert set(config.heads) == heads
    if name == "vqa-base.model":
        assert config.heads["vqa"].num_labels == 3129
    if name == "vl-bert-base-prec.model":
        assert config.heads["mrc"].num_labels == 1601
    e2e = {"vl-bert-base-e2e.model": True, "refcoco+-base.model": True}.get(name, False)
    assert any(".backbone." in key for key in source.ignored()) == e2e  # the ResNet-101 of the e2e models


def test_configs_without_the_new_fields_keep_the_old_vl_bert():
    """Checkpoints vlserve trained before the reference embeddings (config.json without vlbert_embedding / pooler)
    build what they were trained with."""
    enc = {"preset": "vl-bert", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 40,
           "vocab_size": 50, "type_vocab_size": 3, "visual_feat_dim": 16, "max_position_embeddings": 24}
    model = VLModel(ModelConfig.from_dict({"encoder": enc, "heads": {}}))
    keys = set(model.state_dict())
    assert "encoder.pooler.dense.weight" in keys and "encoder.embeddings.end_embedding.weight" not in keys
    assert model.encoder.embeddings.visual_fc.in_features == 16 + 256
    fresh = EncoderConfig(**{**enc, "vlbert_embedding": "reference", "geometry_dim": 2048, "pooler": False})
    assert type(VLModel(ModelConfig(encoder=fresh)).encoder.embeddings).__name__ == "ReferenceVLBertEmbeddings"


@pytest.mark.parametrize("kind, classifier", [("vqa", "dense_gelu"), ("refer", "bert"), ("itm", "bert")])
def test_vl_bert_classifiers_belong_to_their_heads(kind, classifier):
    with pytest.raises(ValueError, match=f"classifier='{classifier}' is for"):
        HeadConfig(kind=kind, classifier=classifier)


# ---- errors: exit code 2, one line naming the file, no traceback --------------------------------------------


def truncated(tmp_path):
    return halved(rewrite(tmp_path, "vqa.model"))


def pickled_object(tmp_path):
    return rewrite(tmp_path, "vqa.model", lambda data: {**data, "config": Path("cfgs/vqa")})


def lxmert_checkpoint(tmp_path):
    src = tmp_path / "BEST.model"
    shutil.copy(FIXTURE.parent / "lxmert_original" / "BEST.pth", src)
    return src


def no_yaml(name):
    def make(tmp_path):
        src = rewrite(tmp_path, name)
        src.with_suffix(".yaml").unlink()
        return src
    return make


def network(edit):
    return lambda config: {**config, "NETWORK": {**config["NETWORK"], "VLBERT": edit(dict(config["NETWORK"]["VLBERT"]))}}


def drop(key):
    return in_state(lambda sd: {k: v for k, v in sd.items() if k != key})


def add(key, value):
    return in_state(lambda sd: {**sd, key: value})


def volta_checkpoint(tmp_path):
    return FIXTURE.parent / "volta" / "pytorch_model_best.bin"


def lfs_pointer(tmp_path):
    """What a clone without Git LFS holds in place of the weights."""
    (tmp_path / "vqa.model").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 913000000\n")
    return tmp_path / "vqa.model"


WORDS, ANSWERS = "module.vlbert.word_embeddings.weight", "module.final_mlp.2.weight"


def answers(lines: str):
    def make(tmp_path):
        (tmp_path / "answers.txt").write_text(lines)
        return rewrite(tmp_path, "vqa.model")
    return make


ERRORS = {
    "directory": (lambda tmp: FIXTURE, "a directory; give the .model file"),
    "no file": (lambda tmp: tmp / "vqa.model", "vqa.model: no such file"),
    "truncated file": (truncated, "vqa.model: unreadable weights, truncated or corrupt"),
    "pickled object": (pickled_object, "vqa.model: unreadable weights: the pickle holds pathlib.PosixPath"),
    "another format's checkpoint": (lxmert_checkpoint, "BEST.model: an airsplay/lxmert fine-tuned model: import it "
                                                       "with `vlserve import lxmert`"),
    "not a checkpoint": (lambda tmp: rewrite(tmp, "vqa.model", lambda data: {"epoch": 3}),
                         "vqa.model: not a VL-BERT checkpoint"),
    "config wider than the weights": (lambda tmp: rewrite(tmp, "vqa.model", yaml_edit=network(lambda v: {**v, "hidden_size": 48})),
                                      "vqa.yaml: hidden_size is 48, but the weights have 32"),
    "config with other layer count": (lambda tmp: rewrite(tmp, "refcoco.model", yaml_edit=network(lambda v: {**v, "num_hidden_layers": 4})),
                                      "refcoco.yaml: num_hidden_layers is 4, but the weights have 2"),
    "config heads that do not divide": (lambda tmp: rewrite(tmp, "vqa.model", yaml_edit=network(lambda v: {**v, "num_attention_heads": 3})),
                                        "vqa.yaml: num_attention_heads 3 does not divide the hidden size 32"),
    "tiny without its config": (no_yaml("vqa.model"), "vqa.model: hidden size 32 is neither BERT-base's nor BERT-large's"),
    "missing tensor": (lambda tmp: rewrite(tmp, "pretrain.model", drop("module.vlbert.encoder.layer.1.output.LayerNorm.bias")),
                       "pretrain.model: source checkpoint lacks module.vlbert.encoder.layer.1.output.LayerNorm.bias"),
    "extra tensor": (lambda tmp: rewrite(tmp, "pretrain.model", add("module.vlbert.adapter.weight", torch.zeros(2))),
                     "pretrain.model: unexpected tensor module.vlbert.adapter.weight"),
    "2fc classifier": (lambda tmp: rewrite(tmp, "vqa.model", add("module.final_mlp.4.weight", torch.zeros(7, 16))),
                       "vqa.model: its VQA classifier is the '2fc' one, which vlserve does not build"),
    "answers of another size": (answers("yes\nno\n"), "answers.txt: 2 answers, but the checkpoint's vqa head has 7"),
    "config dropout not a number": (lambda tmp: rewrite(tmp, "vqa.model", yaml_edit=network(lambda v: {**v, "hidden_dropout_prob": "high"})),
                                    "vqa.yaml: field 'hidden_dropout_prob' is 'high', expected a number"),
    "config dropout above 1": (lambda tmp: rewrite(tmp, "vqa.model", yaml_edit=network(lambda v: {**v, "hidden_dropout_prob": 5})),
                               "vqa.yaml: dropout=5.0 is not a probability in [0, 1]"),
    "config layer count as a string": (lambda tmp: rewrite(tmp, "refcoco.model", yaml_edit=network(lambda v: {**v, "num_hidden_layers": "2"})),
                                       "refcoco.yaml: field 'num_hidden_layers' is '2', expected an integer"),
    "config heads as a string": (lambda tmp: rewrite(tmp, "vqa.model", yaml_edit=network(lambda v: {**v, "num_attention_heads": "2"})),
                                 "vqa.yaml: field 'num_attention_heads' is '2', expected an integer"),
    "a VOLTA checkpoint": (volta_checkpoint, "pytorch_model_best.bin: a VOLTA checkpoint: import it with `vlserve import volta`"),
    "Git LFS pointer": (lfs_pointer, "vqa.model: not a PyTorch weights file but a Git LFS pointer to one: fetch the "
                                     "weights with `git lfs pull`"),
    "1-d word embeddings": (lambda tmp: rewrite(tmp, "vqa.model", in_state(lambda sd: {**sd, WORDS: sd[WORDS].flatten()})),
                            f"vqa.model: tensor {WORDS} has shape (", "), expected a 2-d tensor"),
    "config nested too deeply": (lambda tmp: (rewrite(tmp, "vqa.model"), tmp.joinpath("src", "vqa.yaml").write_text("[" * 5000 + "]" * 5000))[0],
                                 "vqa.yaml: unreadable config (nested too deeply)"),
    "integer classifier": (lambda tmp: rewrite(tmp, "vqa.model", in_state(lambda sd: {**sd, ANSWERS: sd[ANSWERS].long()})),
                           f"vqa.model: tensor {ANSWERS} is int64, not floating point"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_source_exits_2_with_one_clear_message(case, tmp_path):
    assert_bad_source(cli, tmp_path, *ERRORS[case], answers="answers.txt")
