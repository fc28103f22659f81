"""The 12-in-1 ViLBERT of vilbert-multi-task, imported with `vlserve import vilbert` (tests/fixtures/vilbert: the
reference's own VILBertForVLTasks at a tiny size, its outputs proven in tests/models/test_vilbert.py), served end to
end with a detector of its 2048-d feature width: /vqa, /refer, /retrieve and /nlvr2 each answered by its head, every
input carrying that head's task token."""
from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from models.checkpoint import load_checkpoint
from service.app import create_app
from service.collate import pad_and_stack
from service.pipeline import region_arrays
from service.runtime.torch_runtime import to_inputs
from tests.service.conftest import build_tiny_detector
from vlserve.cli import app as cli_app

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vilbert"
# texts are words of the fixture's vocabulary (w0 .. w22, scripts/reference_fixtures): a text of none of them is refused
ANSWERS = [f"answer {i}" for i in range(3129)]  # the size of VQA's trainval_label2ans.json


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def client(tmp_path_factory, make_settings):
    root = tmp_path_factory.mktemp("vilbert_served")
    detector = build_tiny_detector(root / "detector", feature_dim=2048)
    (root / "label2ans.json").write_text(json.dumps(ANSWERS))
    result = CliRunner().invoke(cli_app, ["import", "vilbert", str(FIXTURE / "multi_task_model.bin"), str(root / "model"),
                                          "--config", str(FIXTURE / "multi_task_config.json"),
                                          "--answers", str(root / "label2ans.json")])
    assert result.exit_code == 0, result.output
    settings = make_settings(model_dir=root / "model", detector_dir=detector.dir, precision="fp32")
    with TestClient(create_app(settings)) as c:
        c.model_dir = root / "model"
        yield c


def direct_score(client, text: str, image_id: str) -> float:
    """The rank head's score of (text, image) from the imported model itself, on the service's inputs."""
    pipeline = client.app.state.services.pipeline
    rf = client.portal.call(pipeline.regions.from_id, image_id)
    inputs = to_inputs(pad_and_stack([{**pipeline.text(text, ("text",)), **region_arrays([rf])}]), torch.device("cpu"))
    with torch.no_grad():
        logits = load_checkpoint(client.model_dir).model.eval()(inputs, "rank").logits
    return (logits[0, 1] - logits[0, 0]).item()


def test_imported_12_in_1_answers_every_endpoint(client, make_png):
    model = client.get("/readyz").json()["model"]
    assert model["preset"] == "vilbert"
    ids = []
    for seed in (51, 52, 53):
        r = client.post("/images", json={"image": b64(make_png(seed))})
        assert r.status_code == 200, r.text
        ids.append(r.json()["image_id"])

    r = client.post("/vqa", json={"image_id": ids[0], "question": "w3 w7 w1 w12 w5", "top_k": 3})
    assert r.status_code == 200, r.text
    answers = r.json()["answers"]
    assert len(answers) == 3 and {a["answer"] for a in answers} <= set(ANSWERS)
    assert [a["score"] for a in answers] == sorted((a["score"] for a in answers), reverse=True)
    explained = client.post("/vqa", params={"explain": "true"},
                            json={"image_id": ids[0], "question": "w3 w7 w1 w12 w5", "top_k": 3})
    assert explained.status_code == 200, explained.text  # word-to-region attention: one row per word, no task token
    assert [a["answer"] for a in explained.json()["answers"]] == [a["answer"] for a in answers]

    r = client.post("/refer", json={"image_id": ids[0], "expression": "w12 w4 w5"})
    assert r.status_code == 200, r.text
    body = r.json()
    h, w = body["image_size"]
    x1, y1, x2, y2 = body["box"]
    assert 0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h

    r = client.post("/retrieve", json={"text": "w2 w4 w5", "image_ids": ids, "top_k": 3})
    assert r.status_code == 200, r.text
    hits = r.json()["results"]
    assert sorted(h["image_id"] for h in hits) == sorted(ids)
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    for hit in hits:  # the rank head's logits are (0, vil_logit): probability = sigmoid(score)
        assert hit["probability"] == pytest.approx(1 / (1 + math.exp(-hit["score"])), rel=1e-6)
    # served with its task token, as the model runs alone
    assert hits[0]["score"] == pytest.approx(direct_score(client, "w2 w4 w5", hits[0]["image_id"]), abs=1e-5)
    texts = ["w2 w4 w5", "w9 w6 w8", "w10 w11 w13"]
    r = client.post("/retrieve", json={"image_id": ids[1], "texts": texts, "top_k": 3})
    assert r.status_code == 200, r.text
    assert sorted(h["index"] for h in r.json()["results"]) == [0, 1, 2]

    r = client.post("/nlvr2", json={"images": [{"image_id": ids[0]}, {"image_id": ids[2]}],
                                    "statement": "w14 w15 w16 w2 w4 w5"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert 0 < body["probability"] < 1 and body["answer"] == (body["probability"] >= 0.5)
