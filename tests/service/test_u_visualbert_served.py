"""The weakly-supervised VisualBERT's checkpoints, imported with `vlserve import u-visualbert` from the reference's
tiny fixture (tests/fixtures/u_visualbert), served end to end: /vqa from the fine-tuned VQA model, /retrieve from the
pretrained model's ITM head, /nlvr2 from its lxmert_style_nlvr model, each behind a detector of the width its
checkpoint reads (2048-d regions) whose class names the fixture's vocabulary splits into several sub-words, so every
request carries multi-token region tags. Served scores equal the imported model's own on the same regions and tags.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from models import VLInputs
from models.checkpoint import load_checkpoint
from models.region_features import region_tag_ids
from service.app import create_app
from tests.service.conftest import TINY_DETECTOR, assert_problem, build_tiny_detector, png_bytes, score_tol, shapes_image
from vlserve.cli import app as cli_app

FIXTURE = Path(__file__).parents[1] / "fixtures" / "u_visualbert"
FEAT_DIM = 2048  # the fixture models' region width


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, Path]:
    """A 2048-d tiny detector and the three fixture checkpoints, imported."""
    root = tmp_path_factory.mktemp("u_visualbert_served")
    dirs = {"detector": build_tiny_detector(root / "detector", feature_dim=FEAT_DIM).dir}
    for name, src, options in (("vqa", "vqa.pth", ["--answers", FIXTURE / "label2ans.json"]),
                               ("pretrained", "pretrained_LXRT.pth", []), ("nlvr2", "nlvr2_LXRT.pth", [])):
        result = CliRunner().invoke(cli_app, ["import", "u-visualbert", *map(str, [FIXTURE / src, root / name, *options])])
        assert result.exit_code == 0, result.output
        dirs[name] = root / name
    return dirs


def client(make_settings, served: dict[str, Path], model: str) -> TestClient:
    settings = make_settings(model_dir=served[model], detector_dir=served["detector"], precision="fp32")
    return TestClient(create_app(settings))


def register(c: TestClient, seed: int) -> str:
    r = c.post("/images", json={"image": base64.b64encode(png_bytes(shapes_image(seed=seed))).decode()})
    assert r.status_code == 200, r.text
    assert r.json()["num_boxes"] > 0
    return r.json()["image_id"]


def own_inputs(c: TestClient, image_ids: list[str], text: str) -> VLInputs:
    """What the model is given for these images (regions (1, k, N, ...)) and text: the registered regions, each
    tagged with every sub-word of its detector class name; the service must use that table."""
    pipeline = c.app.state.services.pipeline
    table = pipeline.tokenizer.tag_subwords(TINY_DETECTOR["classes"])
    assert np.array_equal(pipeline.tag_words, table)
    regions = [c.portal.call(pipeline.regions.from_id, i) for i in image_ids]
    enc = pipeline.tokenizer.encode([text])
    stack = lambda xs: torch.as_tensor(np.stack(xs)).unsqueeze(0)  # noqa: E731
    return VLInputs(
        input_ids=torch.as_tensor(enc["input_ids"]), attention_mask=torch.as_tensor(enc["attention_mask"]),
        token_type_ids=torch.as_tensor(enc["token_type_ids"]),
        region_features=stack([rf.features.astype(np.float32) for rf in regions]),
        region_boxes=stack([rf.normalized_boxes().astype(np.float32) for rf in regions]),
        region_mask=stack([rf.region_mask() for rf in regions]),
        tag_ids=stack([region_tag_ids(rf.obj_ids, table) for rf in regions]),
    )


def one_image(x: VLInputs) -> VLInputs:
    return x.replace(**{k: getattr(x, k)[:, 0] for k in ("region_features", "region_boxes", "region_mask", "tag_ids")})


def test_tags_are_every_sub_word_of_the_class_name(served):
    tok = load_checkpoint(served["vqa"]).tokenizer
    table = tok.tag_subwords(["circle", "rectangle", "triangle"])
    assert table.shape == (3, 2) and table[0, 1] == -1 and (table[1:] >= 0).all()  # rect ##angle, tri ##angle


def test_vqa_served_equals_the_model(make_settings, served):
    answers = json.loads((FIXTURE / "label2ans.json").read_text())
    model = load_checkpoint(served["vqa"]).model.eval()
    with client(make_settings, served, "vqa") as c:
        image_id = register(c, 0)
        r = c.post("/vqa", json={"image_id": image_id, "question": "what shape is red?", "top_k": 3})
        assert r.status_code == 200, r.text
        got = r.json()["answers"]
        x = own_inputs(c, [image_id], "what shape is red?")
        with torch.no_grad():
            scores = torch.sigmoid(model(one_image(x), "vqa").logits[0].double())
        best = scores.argsort(descending=True)[:3]
        assert [a["answer"] for a in got] == [answers[i] for i in best]
        assert np.allclose([a["score"] for a in got], scores[best].numpy(), atol=score_tol(c))
        assert_problem(c.post("/retrieve", json={"text": "a red circle", "image_ids": [image_id]}), 404, "no-head")


def test_retrieve_and_nlvr2_served(make_settings, served):
    with client(make_settings, served, "pretrained") as c:
        ids = [register(c, seed) for seed in (0, 1)]
        r = c.post("/retrieve", json={"text": "a red rectangle", "image_ids": ids, "top_k": 2})
        assert r.status_code == 200, r.text
        assert sorted(h["image_id"] for h in r.json()["results"]) == sorted(ids)
        assert_problem(c.post("/vqa", json={"image_id": ids[0], "question": "what?"}), 404, "no-head")
    model = load_checkpoint(served["nlvr2"]).model.eval()
    with client(make_settings, served, "nlvr2") as c:
        ids = [register(c, seed) for seed in (0, 1)]
        statement = "the left image has a triangle"
        r = c.post("/nlvr2", json={"images": [{"image_id": i} for i in ids], "statement": statement})
        assert r.status_code == 200, r.text
        with torch.no_grad():
            logits = model(own_inputs(c, ids, statement), "nlvr2").logits[0]
        assert abs(r.json()["probability"] - torch.softmax(logits.double(), -1)[1].item()) < score_tol(c)


def test_exported_repository_answers_as_torch(make_settings, served, tmp_path):
    """The ONNX graph of the published embeddings takes every sub-word of each region's tag (tag_ids (B, N, K))."""
    from export.repository import export_repository
    from models.repository import load_repository

    repo = tmp_path / "repo"
    export_repository(served["vqa"], repo, examples=8)
    spec = load_repository(repo).graphs["vqa"]
    assert next(i for i in spec.inputs if i.name == "tag_ids").shape == ("batch", "regions", "subwords")
    got = {}
    for name, model_dir, runtime in (("torch", served["vqa"], "torch"), ("onnx", repo, "onnxruntime")):
        settings = make_settings(model_dir=model_dir, detector_dir=served["detector"], precision="fp32", runtime=runtime)
        with TestClient(create_app(settings)) as c:
            image_id = register(c, 2)
            r = c.post("/vqa", json={"image_id": image_id, "question": "is the triangle blue?", "top_k": 3})
            assert r.status_code == 200, r.text
            got[name] = r.json()["answers"]
    assert [a["answer"] for a in got["onnx"]] == [a["answer"] for a in got["torch"]]
    assert np.allclose([a["score"] for a in got["onnx"]], [a["score"] for a in got["torch"]], atol=1e-5)
