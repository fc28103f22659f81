"""Imported VL-BERT checkpoints (`vlserve import vl-bert`) served end to end on the endpoints their heads support.

The tiny fine-tuned VQA and RefCOCO+ models of tests/fixtures/vl_bert (see tests/models/test_vl_bert.py for their
parity with the reference) behind the HTTP API, with a tiny detector of their feature width (2048). /vqa reads the
[MASK] answer slot of the text the service lays out as VL-BERT does ([CLS] q [SEP] [MASK] [SEP]).
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

from fastapi.testclient import TestClient
from typer.testing import CliRunner

from service.app import create_app
from vlserve.cli import app as cli_app

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vl_bert"
# texts are words of the fixture's vocabulary (w0 .. w22, scripts/reference_fixtures): a text of none of them is refused


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def imported(name: str, out: Path, *options: str | Path) -> Path:
    result = CliRunner().invoke(cli_app, ["import", "vl-bert", str(FIXTURE / f"{name}.model"), str(out), *map(str, options)])
    assert result.exit_code == 0, result.output
    return out


def test_imported_vl_bert_serves_vqa_and_refer(tmp_path, make_settings, make_detector, make_png):
    vqa = imported("vqa", tmp_path / "vqa", "--answers", FIXTURE / "answers_vqa.txt")
    refcoco = imported("refcoco", tmp_path / "refcoco")
    feature_dim = json.loads((vqa / "config.json").read_text())["encoder"]["visual_feat_dim"]
    detector = make_detector(tmp_path / "detector", feature_dim=feature_dim)
    answers = (FIXTURE / "answers_vqa.txt").read_text().split()
    image = {"image": b64(make_png(seed=0))}
    with TestClient(create_app(make_settings(model_dir=vqa, detector_dir=detector.dir))) as c:
        r = c.post("/vqa", json={**image, "question": "w3 w7 w1 w12 w17", "top_k": 3})
        assert r.status_code == 200, r.text
        hits = r.json()["answers"]
        assert len(hits) == 3 and {a["answer"] for a in hits} <= set(answers)
        assert c.post("/refer", json={**image, "expression": "w12 w4 w17"}).status_code == 404  # no refer head
    with TestClient(create_app(make_settings(model_dir=refcoco, detector_dir=detector.dir))) as c:
        r = c.post("/refer", json={**image, "expression": "w12 w4 w17"})
        assert r.status_code == 200, r.text
        h, w = r.json()["image_size"]
        x1, y1, x2, y2 = r.json()["box"]
        assert 0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h
