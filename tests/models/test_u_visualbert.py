"""`vlserve import u-visualbert`: parity with the weakly-supervised VisualBERT code (uclanlp/visualbert,
unsupervised_visualbert), its file layouts, and clear errors.

The fixture (tests/fixtures/u_visualbert, see reference.json for the repository and commit) was written by
scripts/reference_fixtures/u_visualbert.py: the reference's own VQAModel, LXRTPretraining and its lxmert_style_nlvr
variant at a tiny config with seeded weights, saved as its code saves them, and their outputs on two padded input
shapes (text, regions and detector tags of different lengths). Imported outputs must equal them within 1e-5 in fp32.
"""
from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from models import VLInputs, VLModel
from models.importers.lxmert_original import BERT_BASE_UNCASED
from models.importers.u_visualbert import convert
from tests.models.reference_checks import (
    add, assert_accounted_for, assert_one_line_error, drop, full_size_source, halved, import_checkpoint, max_diff,
    record, renamed, resaved, run_import, served_tasks,
)
from vlserve.cli import app

FIXTURE = Path(__file__).parents[1] / "fixtures" / "u_visualbert"
LXMERT = Path(__file__).parents[1] / "fixtures" / "lxmert_original"
ATOL = 1e-5
BESIDE = ("bert_config.json", "vocab.txt")  # read from beside the weights file
SHAPES = ("a", "b")  # the fixture's two padded input shapes
FILES = ("vqa.pth", "pretrained_LXRT.pth", "nlvr2_LXRT.pth")


def unused(p: str, heads: str | None, itm: str = "seq_relationship") -> list[str]:
    """The tensors the reference never reads (models/importers/u_visualbert.py UNUSED): ignored, by name. The
    symbolic head is a copy of `cls`, whose ITM classifier is `itm`."""
    keys = [f"{p}embeddings.{n}.weight" for n in ("symbolic_embedding", "token_type_embeddings_visual", "position_embeddings_visual")]
    keys += [f"{p}encoder.visn_fc.{m}.{t}" for m in ("visn_fc", "visn_layer_norm", "box_fc", "box_layer_norm") for t in ("weight", "bias")]
    if heads is not None:
        keys += [f"{heads}symbolic_head.predictions.{k}" for k in ("bias", "decoder.weight", "transform.dense.weight",
                                                                   "transform.dense.bias", "transform.LayerNorm.weight",
                                                                   "transform.LayerNorm.bias")]
        keys += [f"{heads}symbolic_head.{itm}.{t}" for t in ("weight", "bias")]
    return keys


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor]]:
    tensors = load_file(FIXTURE / "reference.safetensors")
    return {s: {k[len(s) + 1:]: v for k, v in tensors.items() if k.startswith(f"{s}.")} for s in SHAPES}


cli = partial(run_import, "u-visualbert")
imported = partial(import_checkpoint, "u-visualbert")


def batch(ref: dict[str, torch.Tensor], pair: bool = False) -> VLInputs:
    """The fixture's inputs; `pair`: row 0's text about the images of rows 0 and 1 (the NLVR2 reference's pairing)."""
    x = VLInputs(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"], token_type_ids=ref["token_type_ids"],
                 region_features=ref["region_features"], region_boxes=ref["region_boxes"],
                 region_mask=ref["region_mask"], tag_ids=ref["tag_ids"])
    if not pair:
        return x
    both = lambda t: t[:2].unsqueeze(0)  # noqa: E731  (1, 2, N, ...)
    return x.replace(input_ids=x.input_ids[:1], attention_mask=x.attention_mask[:1], token_type_ids=x.token_type_ids[:1],
                     region_features=both(x.region_features), region_boxes=both(x.region_boxes),
                     region_mask=both(x.region_mask), tag_ids=both(x.tag_ids))


def tag_diff(ours: torch.Tensor, ref: dict[str, torch.Tensor], want: torch.Tensor) -> float:
    """Tag scores: ours (B, N, K, V) at each real tag slot, the reference's (B, L, V) at its flat list of them
    (region by region, sub-word by sub-word)."""
    real = ref["tag_ids"] >= 0
    assert torch.equal(real.flatten(1).sum(1), ref["ref_tags_mask"].sum(1))
    return max(max_diff(ours[i][real[i]], want[i, : int(real[i].sum())]) for i in range(ours.shape[0]))


def rewrite(tmp_path: Path, name: str, edit=None, beside: dict | None = None) -> Path:
    """The fixture's `name` re-saved into tmp_path (after `edit` of its state), with the files read beside it."""
    return resaved(FIXTURE, tmp_path, name, edit, BESIDE, beside)


# ---- parity -------------------------------------------------------------------------------------------------


def test_reference_recorded():
    ref = json.loads((FIXTURE / "reference.json").read_text())
    assert ref["repository"] == "uclanlp/visualbert" and len(ref["commit"]) == 40
    assert all(name.startswith("unsupervised_visualbert/") for name in ref["sha256"])
    assert ref["model_flags"]["use_bert_input_for_tags"] and ref["model_flags"]["hybrid_embedding"]
    assert sum(f.stat().st_size for f in FIXTURE.iterdir()) < 3_000_000  # tiny widths keep the fixture small


@pytest.mark.parametrize("shape", SHAPES)
def test_fine_tuned_vqa_parity(shape, tmp_path, reference):
    """The published vqa.pth layout (--multiGPU) with its answer table: /vqa answers words, reading the regions'
    tags as tokens (every sub-word of each class name); outputs equal the reference's at both padded shapes."""
    ckpt = imported(FIXTURE / "vqa.pth", tmp_path / "ours", "--answers", FIXTURE / "label2ans.json")
    enc = ckpt.model.config.encoder
    assert set(ckpt.model.config.heads) == {"vqa"}
    assert (enc.preset, enc.embedding_style, enc.region_tags) == ("u-visualbert", "published", True)
    assert served_tasks(ckpt)["vqa"].labels == tuple(json.loads((FIXTURE / "label2ans.json").read_text()))
    info = record(tmp_path / "ours")
    assert info["format"] == "u-visualbert" and info["architecture"] == "VQAModel"
    assert info["ignored_keys"] == sorted(unused("lxrt_encoder.model.module.bert.module.", None))
    ref = reference[shape]
    with torch.no_grad():
        logits = ckpt.model(batch(ref), "vqa").logits
    assert max_diff(logits, ref["vqa.vqa"]) < ATOL


@pytest.mark.parametrize("shape", SHAPES)
def test_pretraining_parity(shape, tmp_path, reference):
    """pretrained_LXRT.pth (`module.` keys): masked LM, ITM, tag reconstruction (at every tag token), object,
    attribute and feature heads, at both padded shapes."""
    ckpt = imported(FIXTURE / "pretrained_LXRT.pth", tmp_path / "ours")
    assert set(ckpt.model.config.heads) == {"mlm", "itm", "tag", "mrc", "attr", "mrfr"}
    assert set(served_tasks(ckpt)) == {"itm"}
    assert record(tmp_path / "ours")["ignored_keys"] == sorted(unused("module.bert.", "module."))
    ref = reference[shape]
    x = batch(ref)
    words, regions = x.attention_mask.bool(), x.region_mask.bool()  # padded positions: not outputs
    with torch.no_grad():
        out = {task: ckpt.model(x, task).logits for task in ckpt.model.config.heads}
    assert max_diff(out["mlm"][words], ref["pretrained.mlm"][words]) < ATOL
    assert max_diff(out["itm"], ref["pretrained.itm"]) < ATOL
    assert tag_diff(out["tag"], ref, ref["pretrained.tag"]) < ATOL
    for task in ("mrc", "attr", "mrfr"):
        assert max_diff(out[task][regions], ref[f"pretrained.{task}"][regions]) < ATOL


@pytest.mark.parametrize("shape", SHAPES)
def test_nlvr2_parity(shape, tmp_path, reference):
    """lxmert_style_nlvr: one pass per image, the pooled vectors concatenated into cls.seq_relationship_new."""
    ckpt = imported(FIXTURE / "nlvr2_LXRT.pth", tmp_path / "ours")
    assert ckpt.model.config.heads["nlvr2"].nlvr2_mode == "pair" and "itm" not in ckpt.model.config.heads
    assert set(served_tasks(ckpt)) == {"nlvr2"}
    ref = reference[shape]
    with torch.no_grad():
        logits = ckpt.model(batch(ref, pair=True), "nlvr2").logits
    assert max_diff(logits, ref["nlvr2.nlvr2"]) < ATOL


def test_segments_and_tag_slots_do_not_matter(tmp_path, reference):
    """The reference embeds every text token in segment 0, and only real tag sub-words count: other segment ids
    and more empty tag slots leave the answer unchanged."""
    ckpt = imported(FIXTURE / "vqa.pth", tmp_path / "ours")
    ref = reference["a"]
    x = batch(ref)
    wider = torch.cat([x.tag_ids, torch.full_like(x.tag_ids[..., :2], -1)], dim=-1)
    with torch.no_grad():
        moved = ckpt.model(x.replace(token_type_ids=1 - x.token_type_ids, tag_ids=wider), "vqa").logits
    assert max_diff(moved, ref["vqa.vqa"]) < ATOL


LAYOUTS = {  # other ways the reference saves the same tensors
    "vqa.pth on one GPU": ("vqa.pth", renamed("lxrt_encoder.model.module.bert.module.", "lxrt_encoder.model.bert."), "vqa"),
    "vqa.pth, encoder alone in DataParallel": ("vqa.pth", renamed("bert.module.", "bert."), "vqa"),
    "_LXRT.pth on one GPU": ("pretrained_LXRT.pth", renamed("module.", ""), "itm"),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_other_layouts_import_alike(case, tmp_path, reference):
    name, edit, task = LAYOUTS[case]
    ckpt = imported(rewrite(tmp_path, name, edit), tmp_path / "ours")
    with torch.no_grad():
        logits = ckpt.model(batch(reference["a"]), task).logits
    assert max_diff(logits, reference["a"][f"{'vqa' if task == 'vqa' else 'pretrained'}.{task}"]) < ATOL


@pytest.mark.parametrize("name", FILES)
def test_full_size_keys_all_accounted_for(name):
    """A state dict of the reference's full-size key set (zero-stride zeros: no memory) maps onto BERT-base-sized
    u-visualbert with nothing missing, left over or mis-shaped; what it leaves is the reference's unused tensors."""
    shapes = json.loads((FIXTURE / "manifest_full.json").read_text())[name]
    source = full_size_source(FIXTURE, shapes, name, dict(BERT_BASE_UNCASED))
    config, weights, labels, _ = convert(source)
    assert config.encoder.size == "base" and config.encoder.visual_feat_dim == 2048  # 768 wide, 12 layers
    assert_accounted_for(source, config, weights)
    p, heads = ("lxrt_encoder.model.module.bert.module.", None) if name == "vqa.pth" else ("module.bert.", "module.")
    itm = "seq_relationship_new" if name == "nlvr2_LXRT.pth" else "seq_relationship"
    assert source.ignored() == sorted(unused(p, heads, itm))
    if name == "vqa.pth":
        assert config.heads["vqa"].num_labels == 3129
    else:
        assert (config.heads["mrc"].num_labels, config.heads["attr"].num_labels) == (1600, 400)


# ---- errors: exit code 2, one line naming the file, no traceback --------------------------------------------


def truncated(tmp_path):
    return halved(rewrite(tmp_path, "vqa.pth"))


def lxmert_checkpoint(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in ("BEST.pth", *BESIDE):
        shutil.copy(LXMERT / f, src / f)
    return src / "BEST.pth"


def bert_config(**changes):
    config = json.loads((FIXTURE / "bert_config.json").read_text()) | changes
    return lambda tmp: rewrite(tmp, "vqa.pth", beside={"bert_config.json": json.dumps(config)})


KEY = "module.bert.encoder.layer.1.attention.self.key.weight"
ATTR = "module.obj_predict_head.decoder_dict.attr.bias"
ERRORS = {
    "directory": (lambda tmp: FIXTURE, "a directory; give the .pth file (snap/vqa.pth, CC_Unsupervised_LXRT.pth)"),
    "truncated file": (truncated, "vqa.pth: unreadable weights, truncated or corrupt"),
    "another format: airsplay/lxmert": (lxmert_checkpoint, "BEST.pth: an airsplay/lxmert checkpoint (regions embedded by "
                                                           "encoder.visn_fc, no tag embeddings): import it with `vlserve import lxmert`"),
    "transformers format": (lambda tmp: rewrite(tmp, "vqa.pth", renamed("lxrt_encoder.model.module.bert.module.", "visual_bert.")),
                            "vqa.pth: transformers' VisualBERT weights: import their directory with `vlserve import hf-visualbert`"),
    "another model": (lambda tmp: rewrite(tmp, "vqa.pth", lambda sd: {"backbone.conv1.weight": torch.zeros(2)}),
                      "vqa.pth: not a uclanlp/visualbert unsupervised_visualbert checkpoint"),
    "config disagrees: hidden size": (bert_config(hidden_size=32), "bert_config.json: hidden_size is 32, but the weights' is 16"),
    "config disagrees: heads": (bert_config(num_attention_heads=3), "bert_config.json: hidden_size=16 is not a multiple of its number of heads (3)"),
    "config disagrees: vocabulary": (bert_config(vocab_size=30522), "bert_config.json: vocab_size is 30522, but the weights' is 128"),
    "negative attention dropout": (bert_config(attention_probs_dropout_prob=-1),
                                   "bert_config.json: attention_dropout=-1.0 is not a probability in [0, 1]"),
    "missing tensor": (lambda tmp: rewrite(tmp, "pretrained_LXRT.pth", drop("module.bert.embeddings.tag_layer_norm.bias")),
                       "pretrained_LXRT.pth: source checkpoint lacks module.bert.embeddings.tag_layer_norm.bias"),
    "extra tensor": (lambda tmp: rewrite(tmp, "pretrained_LXRT.pth", add("module.bert.encoder.adapter.weight", torch.zeros(2))),
                     "pretrained_LXRT.pth: unexpected tensor module.bert.encoder.adapter.weight"),
    "wrong shape": (lambda tmp: rewrite(tmp, "pretrained_LXRT.pth", add(KEY, torch.zeros(8, 16))),
                    f"pretrained_LXRT.pth: tensor {KEY} has shape (8, 16), the model needs (16, 16)"),
    "untied decoder": (lambda tmp: rewrite(tmp, "pretrained_LXRT.pth", add("module.cls.predictions.decoder.weight", torch.zeros(128, 16))),
                       "pretrained_LXRT.pth: module.cls.predictions.decoder.weight is not tied"),
    "two-stream layers": (lambda tmp: rewrite(tmp, "pretrained_LXRT.pth", add("module.bert.encoder.x_layers.0.lang_inter.dense.weight", torch.zeros(2))),
                          "pretrained_LXRT.pth: has module.bert.encoder.x_layers: a two-stream LXMERT"),
    "another format: VL-BERT": (lambda tmp: FIXTURE.parent / "vl_bert" / "refcoco.model",
                                "refcoco.model: a training checkpoint (its tensors under 'state_dict'), not a state dict: "
                                "a VL-BERT .model file; import it with `vlserve import vl-bert`"),
    "1-d answer classifier": (lambda tmp: rewrite(tmp, "vqa.pth", lambda sd: {**sd, "logit_fc.0.weight": sd["logit_fc.0.weight"].flatten()}),
                              "vqa.pth: tensor logit_fc.0.weight has shape (", "), expected a 2-d tensor"),
    "0-d region projection": (lambda tmp: rewrite(tmp, "pretrained_LXRT.pth", add("module.bert.embeddings.visn_fc.weight", torch.tensor(0.5))),
                              "pretrained_LXRT.pth: tensor module.bert.embeddings.visn_fc.weight has shape (), expected a "
                              "2-d tensor"),
    "NaN attribute head": (lambda tmp: rewrite(tmp, "pretrained_LXRT.pth", lambda sd: {
                               **sd, ATTR: torch.full_like(sd[ATTR], float("nan"))}),
                           f"pretrained_LXRT.pth: tensor {ATTR} holds"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_source_exits_2_with_one_clear_message(case, tmp_path):
    make, *messages = ERRORS[case]
    assert_one_line_error(cli(make(tmp_path), tmp_path / "out"), tmp_path / "out", *messages)


def test_lxmert_importer_refuses_it(tmp_path):
    """The other way round: the airsplay/lxmert importer given this format's file fails with one line, exit 2."""
    result = CliRunner().invoke(app, ["import", "lxmert", str(rewrite(tmp_path, "vqa.pth")), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


# ---- the published embedding style --------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    (dict(preset="visualbert", embedding_style="published"), "embedding_style 'published' is u-visualbert's"),
    (dict(preset="u-visualbert", embedding_style="paper"), "unknown embedding_style 'paper'"),
    (dict(preset="u-visualbert", embedding_style="published", box_embedding="normalized"),
     "box_embedding applies to the vlserve embedding style"),
])
def test_embedding_style_is_checked(fields, message):
    from models.config import EncoderConfig

    with pytest.raises(ValueError, match=message):
        EncoderConfig(**fields)


def test_config_without_the_field_keeps_the_vlserve_style():
    """Checkpoints written before the field existed (the demo's u-visualbert) load with the embeddings they had."""
    from models.config import ModelConfig
    from models.single_stream import UVisualBertEmbeddings

    config = ModelConfig.from_dict({"encoder": {"preset": "u-visualbert", "hidden_size": 16, "num_heads": 2,
                                                "intermediate_size": 32, "num_layers": 1, "visual_feat_dim": 8}})
    assert config.encoder.embedding_style == "vlserve"
    assert type(VLModel(config).encoder.embeddings) is UVisualBertEmbeddings


def test_region_tags_of_every_sub_word():
    """Detector class ids -> (N, K) sub-word ids through a (C, K) table, -1 for padded regions and short names."""
    from models.region_features import region_tag_ids

    table = np.array([[5, -1], [7, 8]])
    assert region_tag_ids(np.array([1, 0, -1]), table).tolist() == [[7, 8], [5, -1], [-1, -1]]
    assert region_tag_ids(np.array([1, -1]), np.array([5, 7])).tolist() == [7, -1]  # one word per class, as before
