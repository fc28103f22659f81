"""Grounding analysis: probes read off the caption templates, per-head tallies against hand-computed examples,
attention of every preset, and `vlserve analyze grounding` end to end on a tiny model and detector."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from models import PRESETS, create_model
from models.checkpoint import save_checkpoint
from models.detector import DetectorConfig, RegionDetector
from models.detector.io import save_detector
from models.tokenizer import VLTokenizer
from training.data.region_table import RegionTable
from training.data.shapes_world import WorldConfig, generate_scene
from training.grounding import (
    ENTITY, GroundingExample, GroundingTally, Probe, caption_probes, grounding_examples, probe_tokens, summarize,
    tally_grounding, text_region_attention,
)
from vlserve.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def tokenizer():
    return VLTokenizer.pretrained_minilm()


def annotation(caption: str, phrases: list[tuple[str, tuple]], relations: list[tuple[str, str, list[str]]]) -> dict:
    """A grounding annotation as the generator writes it, spans located by (unique) words of the caption."""
    def span(word: str) -> list[int]:
        start = caption.index(word)
        return [start, start + len(word)]

    return {
        "caption": caption,
        "phrases": [{"span": span(text), "object": i, "box": list(box)} for i, (text, box) in enumerate(phrases)],
        "relations": [{"label": label, "word": span(word), "targets": [[span(t)[1] - len(t.split()[-1]), span(t)[1]]
                                                                        for t in targets]}
                      for label, word, targets in relations],
    }


A, B = (10.0, 10.0, 30.0, 30.0), (60.0, 60.0, 90.0, 80.0)
CAPTION = "a large red circle is left of an small teal rectangle."  # "an" only to make the article's span unique


def test_caption_probes_follow_the_template():
    g = annotation(CAPTION, [("a large red circle", A), ("an small teal rectangle", B)], [
        ("size", "large", ["a large red circle"]), ("color", "red", ["a large red circle"]),
        ("size", "small", ["an small teal rectangle"]), ("color", "teal", ["an small teal rectangle"]),
        ("relation", "left of", ["a large red circle", "an small teal rectangle"]),
    ])
    got = {(p.kind, CAPTION[: p.end].split()[-1], p.box) for p in caption_probes(g)}
    assert got == {
        (ENTITY, "circle", A), ("det", "a", A), ("amod:size", "large", A), ("amod:color", "red", A),
        (ENTITY, "rectangle", B), ("det", "an", B), ("amod:size", "small", B), ("amod:color", "teal", B),
        ("nsubj", "is", A),  # the copula -> the subject
        ("pobj", "of", B),  # the preposition -> its object
    }


def test_generated_captions_give_a_probe_per_word_and_relation():
    examples = grounding_examples(12, split="val")
    assert len(examples) == 12 and [e.row for e in examples] == sorted({e.row for e in examples})
    scenes = {e.row: generate_scene(WorldConfig(), "val", e.row) for e in examples}
    for e in examples:
        boxes = {o.box for o in scenes[e.row].objects}
        words = [(p.kind, e.caption[: p.end].split()[-1].strip(".")) for p in e.probes]
        entities = [w for k, w in words if k == ENTITY]
        assert entities and all(w in ("circle", "rectangle", "triangle") for w in entities)
        assert all(p.box in boxes for p in e.probes)
        assert sum(k == "det" for k, _ in words) == len(entities)
        assert sum(k.startswith("amod") for k, _ in words) == 2 * len(entities)
        assert {w for k, w in words if k == "nsubj"} <= {"is"}
        assert {w for k, w in words if k == "pobj"} <= {"of", "above", "below"}
        assert e.caption.count(" is ") - e.caption.count("there is") == sum(k == "pobj" for k, _ in words)


def test_probes_read_the_last_sub_word(tokenizer):
    caption = "there is a small teal rectangle."
    example = GroundingExample(0, caption, (Probe(ENTITY, caption.index("rectangle") + 9, A),
                                            Probe("amod:color", caption.index("teal") + 4, A)))
    tokens = ["[CLS]", *tokenizer.tokenize(caption), "[SEP]"]
    assert [(k, tokens[i]) for k, i, _ in probe_tokens(tokenizer, example, len(tokens))] == [
        (ENTITY, "##tangle"), ("amod:color", "##l")]  # rec ##tangle, tea ##l
    # words cut off by truncation are dropped: here only the first five tokens are real
    assert probe_tokens(tokenizer, example, 5) == []


# Two examples, one layer, two heads, text -> region attention (T=4 tokens, N=4 region slots).
R0, R1, R2, PAD = [0.0, 0, 2, 2], [2.0, 2, 4, 4], [0.0, 0, 4, 4], [0.0, 0, 0, 0]
# Example 1: [CLS] circle red [SEP]; regions r0, r1, r2 and a padding slot; the detector is surest of r1.
#   "circle" (entity) and "red" (amod:color) both belong to gold box r0.
ATT_1 = torch.tensor([[
    [[0.1, 0.1, 0.0, 0.0],   # head 1 [CLS]                            region mass 0.2
     [0.5, 0.1, 0.2, 0.0],   #        circle -> r0 (IoU 1): right       0.8
     [0.1, 0.1, 0.2, 0.6],   #        red -> r2 (the padding slot's 0.6 does not count; IoU 1/4): wrong   0.4
     [0.0, 0.0, 0.0, 0.0]],  #        [SEP]                              0      -> 1.4 over 4 tokens
    [[0.0, 0.0, 0.0, 0.0],   # head 2 [CLS]                              0
     [0.1, 0.3, 0.2, 0.0],   #        circle -> r1 (IoU 0): wrong        0.6
     [0.4, 0.1, 0.1, 0.0],   #        red -> r0: right                   0.6
     [0.0, 0.0, 0.0, 0.0]],  #        [SEP]                              0      -> 1.2
]])
# Example 2: [CLS] triangle [SEP] [PAD]; regions r0, r1 and two padding slots; the detector is surest of r1.
#   "triangle" (entity) belongs to gold box r1.
ATT_2 = torch.tensor([[
    [[0.2, 0.2, 0.0, 0.0],   # head 1 [CLS]                              0.4
     [0.1, 0.7, 0.0, 0.0],   #        triangle -> r1: right              0.8
     [0.0, 0.0, 0.0, 0.0],   #        [SEP]                              0
     [0.9, 0.1, 0.0, 0.0]],  #        [PAD]: not a text token             -> 1.2 over 3 tokens
    [[0.0, 0.0, 0.0, 0.0],   # head 2                                    0
     [0.3, 0.1, 0.0, 0.0],   #        triangle -> r0: wrong              0.4
     [0.1, 0.1, 0.0, 0.0],   #                                           0.2
     [1.0, 0.0, 0.0, 0.0]],  #        [PAD]                               -> 0.6
]])


def hand_tally() -> GroundingTally:
    tally = GroundingTally(layers=1, heads=2)
    tally.add(ATT_1, torch.tensor([1, 1, 1, 1]), torch.tensor([1, 1, 1, 0]), torch.tensor([R0, R1, R2, PAD]),
              torch.tensor([0.3, 0.9, 0.5]), [ENTITY, "amod:color"], torch.tensor([1, 2]), torch.tensor([R0, R0]))
    tally.add(ATT_2, torch.tensor([1, 1, 1, 0]), torch.tensor([1, 1, 0, 0]), torch.tensor([R0, R1, PAD, PAD]),
              torch.tensor([0.2, 0.8]), [ENTITY], torch.tensor([1]), torch.tensor([R1]))
    return tally


def test_tally_by_hand():
    tally = hand_tally()
    assert tally.counts == {ENTITY: 2, "amod:color": 1}
    # entity: head 1 right on both, head 2 on neither; the baseline (r1 both times) only on "triangle"
    assert tally.accuracy(ENTITY).tolist() == [[1.0, 0.0]]
    assert tally.baseline_accuracy(ENTITY) == 0.5
    assert tally.accuracy("amod:color").tolist() == [[0.0, 1.0]] and tally.baseline_accuracy("amod:color") == 0.0
    assert tally.upper_bound(ENTITY) == 1.0  # r0 and r1 are both gold boxes
    # attention on regions: (1.4 + 1.2) / 7 real text tokens, (1.2 + 0.6) / 7
    assert tally.image_attention().flatten().tolist() == pytest.approx([2.6 / 7, 1.8 / 7])


def test_summary_by_hand():
    report = summarize(hand_tally(), active=0.3, model="m")
    assert report["model"] == "m" and report["entity_words"] == 2 and report["baseline"] == 0.5
    assert report["best_entity_head"] == {"layer": 1, "head": 1, "accuracy": 1.0, "baseline": 0.5, "margin_points": 50.0}
    assert report["syntactic"] == {"amod:color": {"arcs": 1, "layer": 1, "head": 2, "accuracy": 1.0, "baseline": 0.0,
                                                  "margin_points": 100.0}}
    assert [(h["layer"], h["head"], h["entity"], h["active"]) for h in report["heads"]] == [(1, 1, 1.0, True), (1, 2, 0.0, False)]
    assert report["active_heads"] == 1  # 2.6/7 = 0.37 > 0.3 > 1.8/7 = 0.26


@pytest.mark.parametrize("preset", PRESETS)
def test_text_region_attention_of_every_preset(preset, make_batch):
    torch.manual_seed(0)
    model = create_model(preset, "tiny").eval()
    enc = model.config.encoder
    inputs = make_batch(enc)
    with torch.inference_mode():
        att = text_region_attention(model, inputs)
    layers = enc.num_cross_layers if enc.is_two_stream else enc.num_layers
    heads = (enc.coattention_num_heads or enc.image_heads) if preset == "vilbert" else enc.num_heads
    b, t = inputs.input_ids.shape
    assert att.shape == (layers, b, heads, t, inputs.region_features.shape[1])
    padding = att * (1 - inputs.region_mask)[None, :, None, None, :]
    assert padding.abs().max() < 1e-6  # padding regions get no attention
    mass = att.sum(-1)
    assert (mass <= 1 + 1e-5).all() and (mass > 0).all()
    if preset == "lxmert":  # cross-attention attends to regions only
        assert torch.allclose(mass, torch.ones_like(mass), atol=1e-5)


def synthetic_table(examples: list[GroundingExample], dim: int) -> tuple[RegionTable, list[np.ndarray]]:
    """Every object of every scene as a region (its gold box), random features; the detector is surest of object 0."""
    scenes = [generate_scene(WorldConfig(), "val", i) for i in range(examples[-1].row + 1)]
    n = max(len(s.objects) for s in scenes)
    pixel = np.zeros((len(scenes), n, 4), np.float32)
    mask = np.zeros((len(scenes), n), np.int64)
    scores = []
    for i, scene in enumerate(scenes):
        k = len(scene.objects)
        pixel[i, :k] = [o.box for o in scene.objects]
        mask[i, :k] = 1
        scores.append(np.linspace(0.9, 0.1, k, dtype=np.float32))
    g = np.random.default_rng(0)
    table = RegionTable(features=g.standard_normal((len(scenes), n, dim)).astype(np.float16), boxes=pixel / 128.0,
                        pixel_boxes=pixel, mask=mask, obj_ids=np.where(mask == 1, 0, -1), image_feature=None)
    return table, scores


@pytest.mark.parametrize("preset", ["visualbert", "vl-bert", "lxmert"])
def test_tally_on_regions_that_are_the_objects(preset, tokenizer):
    examples = grounding_examples(6)
    torch.manual_seed(0)
    model = create_model(preset, "tiny", visual_feat_dim=16)
    table, scores = synthetic_table(examples, 16)
    tally = tally_grounding(model, tokenizer, examples, table, scores, batch_size=4)
    entity_probes = [p for e in examples for p in e.probes if p.kind == ENTITY]
    assert tally.counts[ENTITY] == len(entity_probes)
    assert tally.upper_bound(ENTITY) == 1.0  # every gold box is a region
    # the baseline picks object 0 of each scene: right exactly for the entities that are object 0
    first = {e.row: generate_scene(WorldConfig(), "val", e.row).objects[0].box for e in examples}
    expected = sum(p.box == first[e.row] for e in examples for p in e.probes if p.kind == ENTITY) / len(entity_probes)
    assert tally.baseline_accuracy(ENTITY) == pytest.approx(expected)
    acc = tally.accuracy(ENTITY)
    assert acc.shape == (2 if preset != "lxmert" else 1, 4) and ((acc >= 0) & (acc <= 1)).all()
    assert ((tally.image_attention() > 0) & (tally.image_attention() <= 1 + 1e-6)).all()


@pytest.fixture(scope="module")
def model_set(tmp_path_factory, tokenizer):
    """A tiny untrained detector and a tiny visualbert checkpoint that says it was trained on it."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    cfg = DetectorConfig(classes=["circle", "rectangle", "triangle"], attributes=["red"], min_size=64, max_size=128,
                         rpn_pre_nms_top_n=100, rpn_post_nms_top_n=30, num_boxes=8, feature_dim=16)
    fingerprint = save_detector(RegionDetector(cfg, pretrained_backbone=False), root / "detector")
    model = create_model("visualbert", "tiny", visual_feat_dim=16)
    save_checkpoint(model, root / "encoder", tokenizer, detector={"fingerprint": fingerprint, "feature_dim": 16})
    save_checkpoint(model, root / "other", tokenizer, detector={"fingerprint": "0123456789abcdef", "feature_dim": 16})
    return root


def analyze(*args):
    return runner.invoke(app, ["analyze", "grounding", *map(str, args), "--threads", "1"])


def test_cli_writes_json_table_and_plot(model_set, tmp_path, monkeypatch):
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    result = analyze(model_set / "encoder", "--detector-dir", model_set / "detector", "--examples", 3, "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "grounding.json").read_text())
    assert report["examples"] == 3 and report["preset"] == "visualbert" and report["layers"] == 2
    assert len(report["heads"]) == 2 * 4 and 0 <= report["baseline"] <= 1
    assert set(report["best_entity_head"]) >= {"layer", "head", "accuracy", "margin_points"}
    assert set(report["syntactic"]) >= {"det", "amod:size", "amod:color"}
    table = (out / "grounding.md").read_text()
    assert "detector-confidence baseline" in table and "| layer | head | entity |" in table
    with Image.open(out / "grounding.png") as png:
        assert png.format == "PNG" and png.size[0] > 400
    assert json.loads(result.stdout)["png"] == str(out / "grounding.png")
    # the regions are cached in the file fine-tuning keeps the val scenes' regions in
    assert list((tmp_path / "cache" / "features").glob("*/shapes-*-val.vlfeat"))


@pytest.mark.parametrize("args, message", [
    (["missing", "--detector-dir", "detector"], "checkpoint directory not found"),
    (["other", "--detector-dir", "detector"], "trained on regions of detector 0123456789abcdef"),
    (["encoder", "--detector-dir", "encoder"], "not a detector directory"),
    (["encoder", "--detector-dir", "detector", "--split", "dev"], "unknown split 'dev'"),
])
def test_cli_bad_input_exits_2(model_set, tmp_path, args, message):
    result = analyze(*(model_set / a if i in (0, 2) else a for i, a in enumerate(args)), "--out", tmp_path / "out")
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and message in result.stderr, result.output
    assert not (tmp_path / "out").exists()
