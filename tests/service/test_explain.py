"""explain=true on every task route: shape and bounds of the attention it answers, equality with the grounding
analysis' attention (models.attention.text_region_attention, which training/grounding.py reads) for the same input,
answers unchanged, and the batched path untouched when it is not asked."""
from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from models.checkpoint import load_checkpoint
from models.inputs import VLInputs
from service.app import create_app
from service.explain import DECIMALS, MAX_HEADS
from service.pipeline import region_arrays
from training import grounding

TOL = 0.5 * 10**-DECIMALS + 1e-5  # rounding to DECIMALS, plus float32 differences between batch shapes


@pytest.fixture(scope="module")
def client(make_settings):
    with TestClient(create_app(make_settings(precision="fp32"))) as c:
        yield c


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def check_entry(entry: dict, text: str, image_id: str, layers: int = 2, heads: int = 4, kind: str = "layer") -> np.ndarray:
    """Shape and bounds of one explanation; its weights as (heads answered, T, N)."""
    assert entry["text"] == text and entry["image_id"] == image_id
    assert entry["tokens"][0] == "[CLS]" and entry["tokens"][-1] == "[SEP]"
    n = len(entry["regions"])
    assert n >= 1 and entry["regions"] == list(range(n)) and len(entry["boxes"]) == n
    assert (entry["layers"], entry["heads_per_layer"], entry["layer_kind"]) == (layers, heads, kind)
    assert entry["ranked_by"] == "layer"  # the tiny checkpoint carries no grounding analysis
    assert [(a["layer"], a["head"]) for a in entry["attention"]] == [
        (l, h) for l in range(1, layers + 1) for h in range(1, heads + 1)][:MAX_HEADS]
    weights = np.array([a["weights"] for a in entry["attention"]])
    assert weights.shape == (min(layers * heads, MAX_HEADS), len(entry["tokens"]), n)
    assert (weights >= 0).all() and (weights.sum(-1) <= 1 + 1e-2).all()  # rows of rounded weights
    assert np.allclose(weights, np.round(weights, DECIMALS))
    return weights


def same_answers(a: dict, b: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        assert json.dumps(a[key]) == json.dumps(b[key]) or np.allclose(
            _numbers(a[key]), _numbers(b[key]), atol=1e-5), key


def _numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in _numbers(value[k])]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return [float(value)] if isinstance(value, (int, float)) else []


def test_vqa_and_refer_explain_shape_bounds_and_unchanged_answers(client, image_png):
    image_id = client.post("/images", json={"image": b64(image_png)}).json()["image_id"]
    for route, field, text, keys in (("/vqa", "question", "what color is the circle?", ("answers",)),
                                     ("/refer", "expression", "the red square", ("box", "score", "region", "runner_up"))):
        body = {"image_id": image_id, field: text}
        plain = client.post(route, json=body).json()
        explained = client.post(route, params={"explain": "true", "timings": "true"}, json=body).json()
        assert "explain" not in plain
        same_answers(plain, explained, keys)
        (entry,) = explained["explain"]
        check_entry(entry, text, image_id)
        assert explained["timings"]["queue"] == 0 and explained["timings"]["encoder"] > 0  # outside the batcher


def test_retrieve_explains_the_best_pair_both_ways(client, make_png):
    ids = [client.post("/images", json={"image": b64(make_png(seed))}).json()["image_id"] for seed in (1, 2, 3)]
    body = {"text": "a red rectangle", "image_ids": ids, "top_k": 3}
    plain = client.post("/retrieve", json=body).json()
    explained = client.post("/retrieve", params={"explain": "true"}, json=body).json()
    assert explained["results"] == plain["results"]  # the ranking comes from the batched path either way
    (entry,) = explained["explain"]
    check_entry(entry, "a red rectangle", plain["results"][0]["image_id"])

    texts = ["two blue squares", "a red rectangle and a blue one"]
    body = {"image_id": ids[0], "texts": texts}
    plain = client.post("/retrieve", json=body).json()
    explained = client.post("/retrieve", params={"explain": "true"}, json=body).json()
    assert explained["results"] == plain["results"]
    (entry,) = explained["explain"]
    check_entry(entry, plain["results"][0]["text"], ids[0])


def test_nlvr2_explains_the_statement_over_each_image(client, make_png):
    left, right = (client.post("/images", json={"image": b64(make_png(seed))}).json()["image_id"] for seed in (4, 5))
    body = {"images": [{"image_id": left}, {"image_id": right}], "statement": "the left image has a red rectangle"}
    plain = client.post("/nlvr2", json=body).json()
    explained = client.post("/nlvr2", params={"explain": "true"}, json=body).json()
    assert explained["answer"] == plain["answer"] and explained["probability"] == pytest.approx(plain["probability"], abs=1e-5)
    entries = explained["explain"]
    assert [e["image_id"] for e in entries] == [left, right]
    for entry in entries:
        check_entry(entry, body["statement"], entry["image_id"])


@pytest.mark.parametrize("preset", ["visualbert", "lxmert"])  # every layer / the cross-modality layers
def test_explain_equals_the_grounding_analysis_attention(preset, make_settings, make_checkpoint, tiny_detector,
                                                         tmp_path, image_png):
    """The service's weights are the grounding analysis' text_region_attention of the same input, rounded."""
    assert grounding.text_region_attention.__module__ == "models.attention"  # one function, not a copy
    model_dir = make_checkpoint(tmp_path / preset, tiny_detector.fingerprint, preset=preset)
    expression = "the small red square"
    with TestClient(create_app(make_settings(model_dir=model_dir, precision="fp32"))) as c:
        response = c.post("/refer", params={"explain": "true"}, json={"image": b64(image_png), "expression": expression})
        (entry,) = response.json()["explain"]
        rf = c.portal.call(c.app.state.services.pipeline.regions.from_id, entry["image_id"])  # the regions served
    two_stream = preset == "lxmert"
    served = check_entry(entry, expression, entry["image_id"], layers=1 if two_stream else 2,
                         kind="cross-modality layer" if two_stream else "layer")

    ckpt = load_checkpoint(model_dir)
    arrays = {**ckpt.tokenizer.encode([expression]), **{k: v[None] for k, v in region_arrays([rf]).items()}}
    inputs = VLInputs(**{k: torch.from_numpy(np.asarray(v, np.float32 if v.dtype.kind == "f" else np.int64))
                         for k, v in arrays.items()})
    with torch.inference_mode():
        reference = grounding.text_region_attention(ckpt.model.eval(), inputs)  # (L, 1, heads, T, N)
    layers, _, heads, t, _ = reference.shape
    reference = reference[:, 0, :, :, : rf.num_boxes].reshape(layers * heads, t, rf.num_boxes).numpy()
    assert served.shape == reference.shape
    assert np.abs(served - reference).max() <= TOL


def test_heads_come_ranked_by_a_grounding_report(make_settings, tiny_checkpoint, tmp_path, image_png):
    """A checkpoint with its grounding analysis (grounding.json) answers the best entity-grounding heads first."""
    ranked = tmp_path / "ranked"
    shutil.copytree(tiny_checkpoint, ranked)
    accuracy = {(1, 1): 0.1, (1, 2): 0.2, (1, 3): 0.05, (1, 4): 0.3, (2, 1): 0.9, (2, 2): 0.0, (2, 3): 0.6, (2, 4): 0.2}
    (ranked / "grounding.json").write_text(json.dumps({"layers": 2, "heads_per_layer": 4, "heads": [
        {"layer": l, "head": h, "entity": a} for (l, h), a in accuracy.items()]}))
    with TestClient(create_app(make_settings(model_dir=ranked, precision="fp32"))) as c:
        (entry,) = c.post("/vqa", params={"explain": "true"}, json={"image": b64(image_png), "question": "what?"}).json()["explain"]
    assert entry["ranked_by"] == "grounding"
    assert [(a["layer"], a["head"]) for a in entry["attention"]] == sorted(accuracy, key=lambda k: -accuracy[k])


def test_the_batched_path_never_runs_explain_and_explain_never_runs_in_a_batch(client, image_png, problem):
    pipeline = client.app.state.services.pipeline
    explainer, batcher = pipeline.explainer, pipeline.batchers[pipeline.spec("vqa").task]
    body = {"image": b64(image_png), "question": "what shape?"}
    explain_run, batch_fn = explainer.run, batcher.fn

    async def refuse(*args):
        raise AssertionError("explained a request that did not ask")

    def no_batch(items):
        raise AssertionError("an explained request went through the batcher")

    try:
        explainer.run = refuse
        assert "explain" not in client.post("/vqa", json=body).json()
        explainer.run, batcher.fn = explain_run, no_batch
        assert client.post("/vqa", params={"explain": "true"}, json=body).json()["explain"]
    finally:
        explainer.run, batcher.fn = explain_run, batch_fn
    pipeline.explainer = None  # a runtime that returns no attention (onnxruntime): a 422 naming explain
    try:
        body_ = problem(client.post("/vqa", params={"explain": "true"}, json=body), 422, "validation-error")
        assert [e["loc"] for e in body_["errors"]] == [["query", "explain"]], body_  # a query parameter, not the body
    finally:
        pipeline.explainer = explainer


def test_images_answer_the_detector_regions_when_asked(client, image_png, tiny_detector):
    plain = client.post("/images", json={"image": b64(image_png)}).json()
    found = client.post("/images", params={"regions": "true"}, json={"image": b64(image_png)}).json()
    assert "regions" not in plain and len(found["regions"]) == found["num_boxes"] >= 1
    for i, region in enumerate(found["regions"]):
        assert region["index"] == i and region["label"] in tiny_detector.detector.config.classes
        assert region["attribute"] in tiny_detector.detector.config.attributes and 0 <= region["score"] <= 1
        x1, y1, x2, y2 = region["box"]
        assert 0 <= x1 <= x2 <= 128 and 0 <= y1 <= y2 <= 96
