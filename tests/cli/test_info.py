"""`vlserve info DIR`: each kind of directory vlserve writes (checkpoint, detector, model repository) is verified and
summarised with exit 0; a manifest kind it does not read is one line and exit 2."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from export.repository import export_repository
from models import create_model
from models.checkpoint import MANIFEST, save_checkpoint
from models.detector import DetectorConfig, RegionDetector
from models.detector.io import load_detector, save_detector
from models.tokenizer import VLTokenizer
from vlserve.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = create_model("lxmert", "tiny", heads={"vqa": {"kind": "vqa", "num_labels": 2}})
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "lxmert", VLTokenizer.pretrained_minilm(),
                           labels={"heads": {"vqa": ["yes", "no"]}})


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    torch.manual_seed(0)
    cfg = DetectorConfig(classes=["circle", "square"], attributes=["red"], min_size=64, max_size=128, num_boxes=8)
    path = tmp_path_factory.mktemp("det") / "detector"
    save_detector(RegionDetector(cfg), path)
    return path


def info(path):
    return runner.invoke(app, ["info", str(path)])


def summary_of(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_checkpoint_is_summarised(checkpoint):
    summary = summary_of(info(checkpoint))
    assert summary["kind"] == "checkpoint" and summary["preset"] == "lxmert" and summary["heads"] == {"vqa": "vqa"}
    assert "model.safetensors" in summary["verified_files"]


def test_a_detector_directory_is_summarised(detector):
    summary = summary_of(info(detector))
    _, fingerprint = load_detector(detector)
    assert summary == {**summary, "kind": "detector", "fingerprint": fingerprint, "family": "efficientnet-fpn",
                       "classes": 2, "attributes": 1, "feature_dim": 512, "regions": 8}
    assert summary["verified_files"] == ["config.json", "labels.json", "model.safetensors"]


def test_a_model_repository_is_summarised(checkpoint, tmp_path):
    repo = export_repository(checkpoint, tmp_path / "repo", examples=8)
    summary = summary_of(info(repo.path))
    assert summary["kind"] == "onnx-repository" and summary["preset"] == "lxmert" and summary["opset"] == 17
    assert summary["graphs"] == {"vqa": {"kind": "vqa", "file": "graphs/vqa.onnx", "fp16": False}}
    assert "graphs/vqa.onnx" in summary["verified_files"]
    assert "onnxruntime sessions are created when the service starts" in summary["graph_check"]
    opened = summary_of(runner.invoke(app, ["info", "--sessions", str(repo.path)]))
    assert opened == {**summary, "graph_check": opened["graph_check"]}
    assert opened["graph_check"].endswith("loaded in onnxruntime CPU sessions as the service loads them")


def test_a_tampered_detector_is_one_line(detector, tmp_path):
    copy = tmp_path / "det"
    copy.mkdir()
    for f in detector.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "labels.json").write_text("{}")
    result = info(copy)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.stderr == f"error: {copy}: file labels.json does not match its sha256 in {MANIFEST} (changed or corrupt)\n"


def test_a_kind_info_does_not_read_is_one_line(detector, tmp_path):
    copy = tmp_path / "other"
    copy.mkdir()
    for f in detector.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps({**manifest, "kind": "feature-cache"}))
    result = info(copy)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.stderr.startswith(f"error: {copy / MANIFEST}: kind 'feature-cache' is not one `vlserve info` reads")
    assert result.stderr.count("\n") == 1
