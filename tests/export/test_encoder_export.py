"""Every preset and every task head kind exported to ONNX: parity with torch at sizes other than the export
sizes (batch, text length, regions, choices all dynamic), inputs as the graph spec says."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from export.encoder import EXPORTED_KINDS, export_task, graph_spec, synthetic_batch, to_torch
from export.fused import fused_attention
from export.parity import MAX_ABS_DIFF, SHAPES, measure, torch_logits
from export.repository import runner
from models import PRESETS, HeadConfig, ModelConfig, VLModel
from models.layers import CrossAttention, SelfAttention
from models.repository import graph_feed, session

KINDS = ("vqa", "refer", "itm", "nlvr2", "multiple_choice", "grounding")
# head options the presets use: VL-BERT answers VQA from the [MASK] slot, VisualBERT reads NLVR2 pairs jointly,
# the demo's U-VisualBERT reads the regions through attention pooling, and for VQA counts and locates them too
VARIANTS = {"vl-bert": [("vqa_slot", "vqa", {"pool": "answer_slot"})],
            "visualbert": [("nlvr2_joint", "nlvr2", {"nlvr2_mode": "joint"})],
            "u-visualbert": [*((f"{kind}_regions", kind, {"pool": "regions"}) for kind in ("vqa", "itm", "nlvr2")),
                             ("vqa_regions_film", "vqa", {"pool": "regions_film"})]}


def build(make_model, preset: str) -> VLModel:
    """A tiny `preset` with one head per served/exported kind (plus the preset's head variant)."""
    model = make_model(preset, *KINDS)
    if preset not in VARIANTS:
        return model.eval()
    heads = {**model.config.heads, **{task: HeadConfig(kind=kind, num_labels=model.config.heads[kind].num_labels, **options)
                                      for task, kind, options in VARIANTS[preset]}}
    torch.manual_seed(1)
    return VLModel(ModelConfig(encoder=model.config.encoder, heads=heads)).eval()


@pytest.mark.parametrize("preset", PRESETS)
def test_every_head_matches_torch_at_other_sizes(preset, make_model, tmp_path):
    model = build(make_model, preset)
    assert set(KINDS) <= set(EXPORTED_KINDS)
    for task in model.config.heads:
        path = tmp_path / f"{task}.onnx"
        spec = export_task(model, task, path)
        sess = session(path)
        assert [i.name for i in sess.get_inputs()] == spec.input_names
        for inp in sess.get_inputs():  # every named axis is dynamic in the graph, fixed ones are numbers
            want = next(i for i in spec.inputs if i.name == inp.name).shape
            assert [d if isinstance(d, int) else "dyn" for d in inp.shape] == [
                d if isinstance(d, int) else "dyn" for d in want], (task, inp.name)
        parity = measure(model, spec, runner(sess), examples=sum(s[0] for s in SHAPES))
        assert parity.max_abs_diff <= MAX_ABS_DIFF and parity.agreement == 1.0, (preset, task, parity)
        assert all(tuple(s) != (2, 8, 6) for s in parity.shapes)  # never the export sizes


@pytest.mark.parametrize("preset, fields", [
    ("u-visualbert", dict(box_embedding="normalized", embedding_style="vlserve")),  # the demo's sin/cos box embedding
    ("vl-bert", dict(vlbert_embedding="volta", whole_image_region=True)),  # VOLTA's VL-BERT (its last slot is [END])
    # VOLTA's controlled LXMERT and VisualBERT: the whole image, the regions' mean, as one more region
    ("lxmert", dict(whole_image_region=True, pooler_style="relu_mul", box_dims=5)),
    ("visualbert", dict(whole_image_region=True, pooler_style="relu_mul")),
])
def test_embedding_variants_match_torch(preset, fields, make_model, tmp_path):
    """Embedding variants that imported or trained checkpoints use export with parity. The parity gives torch a
    whole-image feature as the service does where its detector has one: a graph without that input answers as torch
    does with it (VOLTA's whole image is the regions' mean, which torch read from the detector instead)."""
    model = make_model(preset, "vqa", "refer", **fields).eval()
    for task in model.config.heads:
        spec = export_task(model, task, tmp_path / f"{task}.onnx")
        parity = measure(model, spec, runner(session(tmp_path / f"{task}.onnx")), examples=sum(s[0] for s in SHAPES))
        assert parity.max_abs_diff <= MAX_ABS_DIFF and parity.agreement == 1.0, (task, parity)


def test_graph_inputs_follow_preset_and_head(make_model):
    """Whole-image feature for VL-BERT / ViLBERT, tags for U-VisualBERT, phrases for grounding, pairs for NLVR2."""
    tagged = {"u-visualbert": {"region_tags": True}}
    names = {p: graph_spec(make_model(p, "vqa", **tagged.get(p, {})).config, "vqa").input_names for p in PRESETS}
    assert "image_feature" in names["vl-bert"] and "image_feature" in names["vilbert"]
    assert "image_feature" not in names["lxmert"] and "tag_ids" in names["u-visualbert"]
    # the published embeddings (the preset's) make tags tokens of their own: without region tags there are none
    assert "tag_ids" not in graph_spec(make_model("u-visualbert", "vqa").config, "vqa").input_names
    assert "tag_ids" in graph_spec(make_model("u-visualbert", "vqa", embedding_style="vlserve").config, "vqa").input_names
    config = make_model("lxmert", "nlvr2", "grounding", "multiple_choice").config
    nlvr2 = graph_spec(config, "nlvr2")
    assert nlvr2.inputs[3].shape == ("batch", 2, "regions", config.encoder.visual_feat_dim)
    assert "phrase_index" in graph_spec(config, "grounding").input_names
    assert graph_spec(config, "multiple_choice").inputs[0].shape == ("batch", "choices", "text")
    with pytest.raises(ValueError, match="not exported"):
        graph_spec(make_model("lxmert", "mlm").config, "mlm")


def test_missing_optional_inputs_get_what_torch_does_without_them(make_model, tmp_path):
    """The service may send no image_feature / tag_ids: the feed fills the encoder's own defaults."""
    for preset in ("vl-bert", "u-visualbert"):
        model = make_model(preset, "vqa", **({"region_tags": True} if preset == "u-visualbert" else {})).eval()
        spec = export_task(model, "vqa", tmp_path / f"{preset}.onnx")
        sess = session(tmp_path / f"{preset}.onnx")
        batch = synthetic_batch(model.config, "vqa", batch=3, text_len=6, regions=5, seed=3)
        bare = {k: v for k, v in batch.items() if k not in ("image_feature", "tag_ids")}
        with torch.inference_mode():
            expected = model(to_torch(bare), "vqa").logits.numpy()  # the encoder's own defaults
        got = sess.run(None, graph_feed(spec, bare))[0]
        np.testing.assert_allclose(got, expected, atol=MAX_ABS_DIFF)


def test_dynamo_exporter_also_passes_parity(make_model, tmp_path):
    """The torch 2.14 default exporter (slower; no fused attention): multiple choice, the head it once got wrong."""
    model = make_model("visualbert", "multiple_choice").eval()
    path = tmp_path / "multiple_choice.onnx"
    spec = export_task(model, "multiple_choice", path, opset=18, exporter="dynamo")
    assert onnx.load(str(path)).opset_import[0].version >= 18
    parity = measure(model, spec, runner(session(path)), examples=16)
    assert parity.max_abs_diff <= MAX_ABS_DIFF and parity.agreement == 1.0


def test_synthetic_batches_are_padded_like_the_service(make_model):
    model = make_model("vl-bert", "vqa", options={"pool": "answer_slot"})
    batch = synthetic_batch(model.config, "vqa", batch=4, text_len=9, regions=6, seed=0)
    lengths = batch["attention_mask"].sum(1)
    ids = batch["input_ids"]
    assert lengths[0] == 9 and (ids[np.arange(4), lengths - 1] == 102).all() and (ids[np.arange(4), lengths - 2] == 103).all()
    assert (ids * (1 - batch["attention_mask"]) == 0).all() and (batch["region_features"] >= 0).all()
    assert (batch["region_features"][batch["region_mask"] == 0] == 0).all()
    boxes = batch["region_boxes"][batch["region_mask"] == 1]
    assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all() and boxes.max() <= 1
    assert torch_logits(model.eval(), "vqa", batch).shape == (4, 7)


@pytest.mark.parametrize("preset", ["visualbert", "vilbert"])
def test_fused_attention_computes_what_the_modules_do_and_exports_as_one_node(preset, make_model, tmp_path):
    model = make_model(preset, "vqa", "refer").eval()
    batch = synthetic_batch(model.config, "refer", batch=3, text_len=7, regions=5, seed=4)
    plain = torch_logits(model, "refer", batch)
    with fused_attention(model) as count:
        assert count == sum(isinstance(m, (SelfAttention, CrossAttention)) for m in model.modules())
        np.testing.assert_allclose(torch_logits(model, "refer", batch), plain, atol=1e-6)
        spec = export_task(model, "refer", tmp_path / "refer.onnx")
    np.testing.assert_array_equal(torch_logits(model, "refer", batch), plain)  # unpatched afterwards
    ops = [n.op_type for n in onnx.load(str(tmp_path / "refer.onnx")).graph.node]
    assert "Softmax" not in ops and ops.count("Attention") == model.config.encoder.num_layers + (
        model.config.encoder.num_image_layers if preset == "vilbert" else 0)
    parity = measure(model, spec, runner(session(tmp_path / "refer.onnx")), examples=16)
    assert parity.max_abs_diff <= MAX_ABS_DIFF and parity.agreement == 1.0
