"""`vlserve import volta`: parity with VOLTA's own models (e-bug/volta), full-size key sets, clear errors.

The fixture (tests/fixtures/volta, see reference.json for the repository and commit) was written by
scripts/reference_fixtures/volta.py: the reference's BertForVLTasks (VQA, retrieval, RefCOCO+, NLVR2 and visual
entailment heads) and BertForVLPreTraining at five tiny configs (ViLBERT-style at the top, its controlled LXMERT in
ctrl_lxmert/, its conversion of the original LXMERT in original_lxmert/, its controlled VisualBERT in ctrl_visualbert/,
its controlled VL-BERT in ctrl_vl-bert/)
with seeded weights, saved as its code saves them, and their outputs on padded inputs of two shapes. Imported outputs
must equal them within 1e-5 in fp32.
"""
from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models import VLInputs
from models.importers.volta import convert
from tests.models.reference_checks import (
    add, assert_accounted_for, assert_bad_source, drop, full_size_source, halved, import_checkpoint, max_diff,
    record, resaved, run_import, served_tasks,
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "volta"
CONFIG = FIXTURE / "vilbert_tiny.json"
VARIANTS = {  # tiny model -> its folder, whether the whole image leads its regions, its pretraining heads
    "vilbert": (FIXTURE, True, {"mlm": "", "itm": "", "mrc": "0"}),
    "ctrl_lxmert": (FIXTURE / "ctrl_lxmert", True, {"mlm": "", "itm": "", "mrc": "0"}),
    "original_lxmert": (FIXTURE / "original_lxmert", False, {"mlm": "", "itm": "", "mrc": "3", "mrfr": "5", "image_qa": ""}),
    "ctrl_visualbert": (FIXTURE / "ctrl_visualbert", True, {"mlm": "", "itm": "", "mrc": "0"}),
    "ctrl_vl-bert": (FIXTURE / "ctrl_vl-bert", True, {"mlm": "", "itm": "", "mrc": "0"}),
}
PRESETS = {"vilbert": "vilbert", "ctrl_lxmert": "lxmert", "original_lxmert": "lxmert", "ctrl_visualbert": "visualbert",
           "ctrl_vl-bert": "vl-bert"}
ATOL = 1e-5
SHAPES = ("", "wide.")  # the generator's two padded input shapes
TASKS, PRETRAINED = "pytorch_model_best.bin", "pytorch_model_9.bin"
VE = ["clfs_dict.TASK13.bias", "clfs_dict.TASK13.weight"]  # visual entailment: no vlserve endpoint
ATTR = ["cls.imagePredictions.decoder_dict.4.bias", "cls.imagePredictions.decoder_dict.4.weight"]  # no attribute head


cli = partial(run_import, "volta")
imported = partial(import_checkpoint, "volta")  # the config json beside the weights


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    return imported(FIXTURE / TASKS, tmp_path_factory.mktemp("volta") / "tasks", "--answers", FIXTURE / "label2ans.json")


def batch(ref: dict[str, torch.Tensor], p: str) -> VLInputs:
    return VLInputs(input_ids=ref[f"{p}input_ids"], attention_mask=ref[f"{p}attention_mask"],
                    token_type_ids=ref[f"{p}token_type_ids"], region_features=ref[f"{p}region_features"],
                    region_boxes=ref[f"{p}region_boxes"], region_mask=ref[f"{p}region_mask"])


def pairs(ref: dict[str, torch.Tensor], p: str) -> VLInputs:
    """NLVR2's inputs: each statement with its left and right image's regions, (B, 2, N, ...)."""
    x = batch(ref, p)
    both = lambda name: torch.stack([ref[f"{p}{name}"], ref[f"{p}{name}_right"]], 1)  # noqa: E731
    return x.replace(region_features=both("region_features"), region_boxes=both("region_boxes"),
                     region_mask=torch.stack([x.region_mask] * 2, 1))


# ---- parity -------------------------------------------------------------------------------------------------


def test_reference_recorded():
    ref = json.loads((FIXTURE / "reference.json").read_text())
    assert ref["repository"] == "e-bug/volta" and len(ref["commit"]) == 40
    size = sum(f.stat().st_size for f in FIXTURE.rglob("*") if f.is_file())
    assert size < 5_000_000 and max(f.stat().st_size for f in FIXTURE.rglob("*")) < 1_000_000  # tiny widths


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_task_heads_parity(variant, tmp_path):
    """BertForVLTasks: VQA (TASK1), retrieval (TASK8), RefCOCO+ (TASK10) and NLVR2 (TASK12) equal the reference's,
    at both padded shapes."""
    folder, whole_image, _ = VARIANTS[variant]
    model = imported(folder / TASKS, tmp_path / "ours").model
    assert set(model.config.heads) == {"vqa", "rank", "refer", "nlvr2"}
    assert model.config.encoder.preset == PRESETS[variant]
    reference = load_file(folder / "reference.safetensors")
    first = 1 if whole_image else 0  # VOLTA scores the whole image too; vlserve's refer head the detector's regions
    for p in SHAPES:
        x = batch(reference, p)
        regions = x.region_mask.bool()
        with torch.no_grad():
            vqa, rank, refer = (model(x, task).logits for task in ("vqa", "rank", "refer"))
            nlvr2 = model(pairs(reference, p), "nlvr2").logits
        assert max_diff(vqa, reference[f"{p}tasks.TASK1"]) < ATOL
        assert max_diff(rank[:, 1] - rank[:, 0], reference[f"{p}tasks.TASK8"][:, 0]) < ATOL  # VOLTA's retrieval score
        assert max_diff(refer[regions], reference[f"{p}tasks.TASK10"][:, first:, 0][regions]) < ATOL
        assert max_diff(nlvr2, reference[f"{p}tasks.TASK12"]) < ATOL
        # a detector's whole-image feature, which the service sends where its detector has one, is not VOLTA's: its
        # whole image is the mean of the regions' features (torch used the detector's; the exported graphs did not)
        given = x.replace(image_feature=torch.rand(x.region_features.shape[0], x.region_features.shape[-1]) * 3)
        with torch.no_grad():
            assert max_diff(model(given, "vqa").logits, reference[f"{p}tasks.TASK1"]) < ATOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pretraining_heads_parity(variant, tmp_path):
    """BertForVLPreTraining: masked LM, ITM (VOLTA's [match, no match] read as [no match, match]), region classes
    (and, where the model has them, feature regression and image QA), at both padded shapes."""
    folder, whole_image, heads = VARIANTS[variant]
    ckpt = imported(folder / PRETRAINED, tmp_path / "ours")
    model = ckpt.model
    assert set(model.config.heads) == set(heads)
    assert record(tmp_path / "ours")["ignored_keys"] == (ATTR if "mrfr" in heads else [])
    reference = load_file(folder / "reference.safetensors")
    first = 1 if whole_image else 0
    for p in SHAPES:
        x = batch(reference, p)
        words, regions = x.attention_mask.bool(), x.region_mask.bool()
        with torch.no_grad():
            out = {task: model(x, task).logits for task in model.config.heads}
        assert max_diff(out["mlm"][words], reference[f"{p}pre.mlm"][words]) < ATOL
        assert max_diff(out["itm"], reference[f"{p}pre.itm"].flip(-1)) < ATOL
        for task in ("mrc", "mrfr"):
            if task in heads:
                theirs = reference[f"{p}pre.visual.{heads[task]}"][:, first:]
                assert max_diff(out[task][regions], theirs[regions]) < ATOL
        if "image_qa" in heads:
            assert max_diff(out["image_qa"], reference[f"{p}pre.image_qa"]) < ATOL


def test_import_records_what_it_left_out(fine_tuned, tmp_path):
    """The visual-entailment head has no endpoint: listed by name, and the CLI says so; the VQA answers are named."""
    result = cli(FIXTURE / TASKS, tmp_path / "out", "--config", CONFIG)
    assert result.exit_code == 0, result.output
    assert "warning: 2 source tensors not imported" in result.stderr and VE[0] in result.stderr
    info = record(tmp_path / "out")
    assert info["format"] == "volta" and info["architecture"] == "BertForVLTasks" and info["ignored_keys"] == VE
    assert fine_tuned.labels["heads"]["vqa"] == json.loads((FIXTURE / "label2ans.json").read_text())
    specs = served_tasks(fine_tuned)
    assert {kind: spec.task for kind, spec in specs.items()} == {"vqa": "vqa", "itm": "rank", "refer": "refer",
                                                                 "nlvr2": "nlvr2"}


def test_config_given_from_elsewhere(tmp_path):
    """The weights alone, the config named with --config (as VOLTA's config/ folder holds it)."""
    (tmp_path / "src").mkdir()
    for name in (TASKS, "vocab.txt"):
        shutil.copy(FIXTURE / name, tmp_path / "src" / name)
    ckpt = imported(tmp_path / "src" / TASKS, tmp_path / "out", "--config", CONFIG)
    reference = load_file(FIXTURE / "reference.safetensors")
    with torch.no_grad():
        logits = ckpt.model(batch(reference, ""), "vqa").logits
    assert max_diff(logits, reference["tasks.TASK1"]) < ATOL


FULL = {  # VOLTA's published config -> preset, (text, image, cross layers), widths (image, bi-attention, pooled)
    "ctrl_vilbert_base": ("vilbert", (12, 6, 6), (768, 768, 1024)),
    "vilbert_base": ("vilbert", (12, 6, 6), (1024, 1024, 1024)),
    "ctrl_lxmert": ("lxmert", (9, 5, 5), (768, 768, 1024)),
    "original_lxmert": ("lxmert", (9, 5, 5), (768, 768, 768)),
    "ctrl_visualbert_base": ("visualbert", (12, 0, 0), (768, 768, 1024)),
    "ctrl_vl-bert_base": ("vl-bert", (12, 0, 0), (768, 768, 1024)),
}


@pytest.mark.parametrize("name", list(FULL))
@pytest.mark.parametrize("weights", [TASKS, PRETRAINED])
def test_full_size_keys_all_accounted_for(name, weights):
    """A state dict of the reference's full-size key set (zero-stride zeros: no memory) for VOLTA's published config
    maps onto a full-size model with nothing missing, left over or mis-shaped."""
    full = json.loads((FIXTURE / "manifest_full.json").read_text())[name]
    source = full_size_source(FIXTURE, full[weights], weights, full["config"], config_file=f"{name}.json")
    config, tensors, _, _ = convert(source)
    enc = config.encoder
    preset, layers, widths = FULL[name]
    assert enc.preset == preset and (enc.num_layers, enc.num_image_layers, enc.num_cross_layers) == layers
    assert (enc.image_width, enc.coattention_width if preset == "vilbert" else enc.hidden_size, enc.pooled_size) == widths
    if preset == "vilbert":
        assert enc.coattention_text_layers == (6, 7, 8, 9, 10, 11)
    if preset == "vl-bert":  # VOLTA's embeddings, 8 x 256 sin/cos values of box geometry, segments A, B and C
        assert (enc.vlbert_embedding, enc.geometry_width, enc.type_vocab_size) == ("volta", 2048, 3)
    assert_accounted_for(source, config, tensors)
    if weights == TASKS:
        assert set(config.heads) == {"vqa", "rank", "refer", "nlvr2"} and config.heads["vqa"].num_labels == 3129
        assert config.heads["vqa"].classifier_hidden == 1536 and source.ignored() == VE
    elif name == "original_lxmert":  # object, attribute and feature targets, LXMERT's 9500-way image QA
        assert set(config.heads) == {"mlm", "itm", "mrc", "mrfr", "image_qa"} and source.ignored() == ATTR
        assert config.heads["image_qa"].num_labels == 9500 and config.heads["mrc"].num_labels == 1600
    else:
        assert set(config.heads) == {"mlm", "itm", "mrc"} and source.ignored() == []


# ---- errors: exit code 2, one line naming the file, no traceback --------------------------------------------


def rewrite(tmp_path: Path, name: str, edit=None, config: dict | None = None) -> Path:
    """The fixture's `name` re-saved into tmp_path (after `edit` of its state), with a config beside it."""
    tiny = json.loads(CONFIG.read_text())
    written = {"vilbert_tiny.json": json.dumps(tiny | (config or {}))}
    return resaved(FIXTURE, tmp_path, name, edit, ("vocab.txt",), written)


def other_config(name: str):
    """The tiny weights beside one of VOLTA's other published configs."""
    def make(tmp_path):
        src = rewrite(tmp_path, TASKS)
        full = json.loads((FIXTURE / "manifest_full.json").read_text())[name]["config"]
        (src.parent / "vilbert_tiny.json").write_text(json.dumps(full))
        return src
    return make


def changed_config(variant: str, change: dict):
    """A tiny fixture's weights beside its config with `change`."""
    def make(tmp_path):
        src = tmp_path / "src"
        src.mkdir()
        folder = VARIANTS[variant][0]
        for name in (TASKS, "vocab.txt"):
            shutil.copy(folder / name, src / name)
        config = next(folder.glob("*_tiny.json"))
        (src / config.name).write_text(json.dumps(json.loads(config.read_text()) | change))
        return src / TASKS
    return make


def truncated(tmp_path):
    return halved(rewrite(tmp_path, TASKS))


def lxmert_best(tmp_path):
    return FIXTURE.parent / "lxmert_original" / "BEST.pth"  # no VOLTA config beside it: the format is told first


KEY = "bert.encoder.layer.4.attention_self.v_key.weight"
ERRORS = {
    "directory": (lambda tmp: FIXTURE, "a directory; give the weights file"),
    "no file": (lambda tmp: tmp / TASKS, f"{TASKS}: no such file"),
    "truncated file": (truncated, f"{TASKS}: unreadable weights, truncated or corrupt"),
    "vilbert-multi-task checkpoint": (lambda tmp: rewrite(tmp, TASKS, add("bert.encoder.c_layer.0.biattention.query1.weight", torch.zeros(2))),
                                      f"{TASKS}: a vilbert-multi-task checkpoint: import it with `vlserve import vilbert`"),
    "airsplay/lxmert checkpoint": (lxmert_best, "BEST.pth: an airsplay/lxmert checkpoint: import it with `vlserve import lxmert`"),
    "another model": (lambda tmp: rewrite(tmp, TASKS, lambda sd: {"backbone.conv1.weight": torch.zeros(2)}),
                      f"{TASKS}: not a VOLTA checkpoint"),
    "config with fewer layers than the weights": (
        lambda tmp: rewrite(tmp, TASKS, config={"tt_attn_sublayers": [0, 2], "t_ff_sublayers": [1, 3, 5, 9]}),
        f"{TASKS}: unexpected tensor bert.encoder.layer.6."),
    "config that is no ViLBERT": (lambda tmp: rewrite(tmp, TASKS, config={"tt_attn_sublayers": [0, 2, 4, 6]}),
                                  "sublayer 4 mixes attentions (tt, tv, vt)"),
    "config of other widths than the weights": (lambda tmp: rewrite(tmp, TASKS, config={"intermediate_size": 48}),
                                               f"{TASKS}: tensor bert.encoder.layer.1.intermediate.dense.weight has shape (40, 16), the model needs (48, 16)"),
    "missing tensor": (lambda tmp: rewrite(tmp, PRETRAINED, drop("bert.encoder.layer.9.output.v_LayerNorm.bias")),
                       f"{PRETRAINED}: source checkpoint lacks bert.encoder.layer.9.output.v_LayerNorm.bias"),
    "extra tensor": (lambda tmp: rewrite(tmp, PRETRAINED, add("bert.encoder.adapter.weight", torch.zeros(2))),
                     f"{PRETRAINED}: unexpected tensor bert.encoder.adapter.weight"),
    "wrong shape": (lambda tmp: rewrite(tmp, TASKS, add(KEY, torch.zeros(6, 12))),
                    f"{TASKS}: tensor {KEY} has shape (6, 12), the model needs (12, 12)"),
    "no config": (lambda tmp: (rewrite(tmp, TASKS), (tmp / "src" / "vilbert_tiny.json").unlink())[0],
                  f"{TASKS}: give the VOLTA config it was trained with"),
    "VL-BERT-style config with the whole image last and no pooler": (
        other_config("vl-bert_base"), "a VL-BERT-style config with add_global_imgfeat 'last' and fusion_method 'none'"),
    "VL-BERT-style config of two LayerNorms": (changed_config("ctrl_vl-bert", {"single_ln_sublayers": []}),
                                               "a VL-BERT-style config whose sublayers are not one shared stack"),
    "VL-BERT-style config of two widths": (changed_config("ctrl_vl-bert", {"v_hidden_size": 12}),
                                           "v_hidden_size differs from hidden_size (VOLTA's visual_1x1 projections)"),
    "VL-BERT-style config with VL-BERT's masked-region target": (
        changed_config("ctrl_vl-bert", {"visual_target_weights": {"6": 1.0}}), "visual target 6 (masked-region classes"),
    "UNITER-style config": (other_config("ctrl_uniter_base"), "image_embeddings 'uniter' (UNITER-style)"),
    "sum fusion": (lambda tmp: rewrite(tmp, TASKS, config={"fusion_method": "sum"}),
                   "fusion_method 'sum': vlserve pools a ViLBERT-style model as the product of its two poolers"),
    "LXMERT-style config of two feed-forward widths": (changed_config("ctrl_lxmert", {"v_intermediate_size": 48}),
                                                       "intermediate_size 40 but v_intermediate_size 48; vlserve's lxmert has one size"),
    "LXMERT-style config with unshared cross-attention": (changed_config("ctrl_lxmert", {"shared_sublayers": []}),
                                                          "sublayers 4-6 are not an LXMERT cross-modality layer"),
    "VisualBERT-style config of two LayerNorms": (changed_config("ctrl_visualbert", {"single_ln_sublayers": []}),
                                                  "a VisualBERT-style config whose sublayers are not one shared stack"),
    "dropout above 1": (lambda tmp: rewrite(tmp, TASKS, config={"hidden_dropout_prob": 7}),
                        "vilbert_tiny.json: dropout=7.0 is not a probability in [0, 1]"),
    "no image-stream heads": (lambda tmp: rewrite(tmp, TASKS, config={"v_num_attention_heads": 0}),
                              "vilbert_tiny.json: field 'v_num_attention_heads' is 0, expected at least 1"),
    "sublayer overrides not by layer number": (
        lambda tmp: rewrite(tmp, TASKS, config={"sublayer2attn_hidden_size": {"first": 16}}),
        "vilbert_tiny.json: field 'sublayer2attn_hidden_size' is {'first': 16}, expected layer numbers as its keys"),
    "answers of another size": (lambda tmp: (tmp.joinpath("answers.json").write_text('["yes", "no"]'), rewrite(tmp, TASKS))[1],
                                "answers.json: 2 answers, but the checkpoint's vqa head has 7"),
    "0-d VQA classifier": (lambda tmp: rewrite(tmp, TASKS, add("clfs_dict.TASK1.logit_fc.3.weight", torch.tensor(0.5))),
                           f"{TASKS}: tensor clfs_dict.TASK1.logit_fc.3.weight has shape (), expected a 2-d tensor"),
    "1-d VQA classifier input": (lambda tmp: rewrite(tmp, TASKS, add("clfs_dict.TASK1.logit_fc.0.weight", torch.zeros(720))),
                                 f"{TASKS}: tensor clfs_dict.TASK1.logit_fc.0.weight has shape (720,), expected a 2-d tensor"),
    "0-d bias of a fused projection": (lambda tmp: rewrite(tmp, TASKS, add("bert.encoder.layer.0.attention_self.key.bias", torch.tensor(0.5))),
                                       f"{TASKS}: tensor bert.encoder.layer.0.attention_self.key.bias has shape (), "
                                       "expected a 1-d or 2-d tensor"),
    "integer ITM classifier": (lambda tmp: rewrite(tmp, PRETRAINED, add("cls.bi_seq_relationship.bias", torch.ones(2, dtype=torch.int32))),
                               f"{PRETRAINED}: tensor cls.bi_seq_relationship.bias is int32, not floating point"),
    "negative LayerNorm eps": (lambda tmp: rewrite(tmp, TASKS, config={"layer_norm_eps": -1.0}),
                               "vilbert_tiny.json: field 'layer_norm_eps' is -1.0, expected a number above 0"),
}


def test_a_json_nested_too_deeply_beside_the_weights_is_not_taken_for_the_config(tmp_path):
    src = rewrite(tmp_path, TASKS)
    (src.parent / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    result = cli(src, tmp_path / "out")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_source_exits_2_with_one_clear_message(case, tmp_path):
    assert_bad_source(cli, tmp_path, *ERRORS[case])


def test_lxmert_fields_belong_to_lxmert():
    from models.config import EncoderConfig

    with pytest.raises(ValueError, match="are lxmert's, visualbert's and vl-bert's with vlbert_embedding 'volta'"):
        EncoderConfig(preset="vilbert", whole_image_region=True)
    with pytest.raises(ValueError, match="vl-bert's with vlbert_embedding 'volta'"):  # jackroos/VL-BERT's has its own
        EncoderConfig(preset="vl-bert", vlbert_embedding="reference", whole_image_region=True)
    with pytest.raises(ValueError, match="needs whole_image_region"):
        EncoderConfig(preset="lxmert", pooler_style="relu_mul")
    with pytest.raises(ValueError, match="box_dims 4 or 5"):
        EncoderConfig(preset="lxmert", box_dims=6)
