"""An imported VOLTA checkpoint (`vlserve import volta`) served end to end on every endpoint its heads support.

The tiny BertForVLTasks of tests/fixtures/volta, ViLBERT-, LXMERT-, VisualBERT- and VL-BERT-style (VQA, retrieval,
RefCOCO+ and NLVR2 heads; see tests/models/test_volta.py for their parity with the reference) behind the HTTP API,
with a tiny detector of their feature width.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from service.app import create_app
from vlserve.cli import app as cli_app

FIXTURE = Path(__file__).parents[1] / "fixtures" / "volta"
# texts are words of the fixture's vocabulary (w0 .. w22, scripts/reference_fixtures): a text of none of them is refused


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("folder", ["", "ctrl_lxmert", "ctrl_visualbert", "ctrl_vl-bert"])
def test_imported_volta_serves_vqa_refer_retrieve_and_nlvr2(folder, tmp_path, make_settings, make_detector, make_png):
    out = tmp_path / "volta"
    result = CliRunner().invoke(cli_app, ["import", "volta", str(FIXTURE / folder / "pytorch_model_best.bin"), str(out),
                                          "--answers", str(FIXTURE / "label2ans.json")])
    assert result.exit_code == 0, result.output
    feature_dim = json.loads((out / "config.json").read_text())["encoder"]["visual_feat_dim"]
    detector = make_detector(tmp_path / "detector", feature_dim=feature_dim)
    answers = json.loads((FIXTURE / "label2ans.json").read_text())
    with TestClient(create_app(make_settings(model_dir=out, detector_dir=detector.dir))) as c:
        ids = []
        for seed in range(2):
            r = c.post("/images", json={"image": b64(make_png(seed=seed))})
            assert r.status_code == 200, r.text
            ids.append(r.json()["image_id"])
        r = c.post("/vqa", json={"image_id": ids[0], "question": "w3 w7 w1 w12 w17", "top_k": 3})
        assert r.status_code == 200, r.text
        hits = r.json()["answers"]
        assert len(hits) == 3 and {a["answer"] for a in hits} <= set(answers)
        r = c.post("/refer", json={"image_id": ids[0], "expression": "w12 w4 w17"})
        assert r.status_code == 200, r.text
        h, w = r.json()["image_size"]
        x1, y1, x2, y2 = r.json()["box"]
        assert 0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h
        r = c.post("/retrieve", json={"text": "w2 w4 w17", "image_ids": ids, "top_k": 2})
        assert r.status_code == 200, r.text
        assert sorted(hit["image_id"] for hit in r.json()["results"]) == sorted(ids)
        r = c.post("/nlvr2", json={"images": [{"image_id": i} for i in ids], "statement": "w14 w16 w2 w17"})
        assert r.status_code == 200, r.text
