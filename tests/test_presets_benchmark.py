"""benchmarks/presets.py (`make results`) refuses recorded results of another budget before it prepares any data."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE_RESULTS = ["--finetune-steps", "600", "--lead-steps", "150", "--demo-levers", "--pretrain-steps", "300",
                "--grounded-mlm"]


class Prepared(Exception):
    """Raised by the stand-in for prepare_task_data: the run got as far as preparing its data."""


@pytest.fixture
def presets(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = importlib.import_module("presets")

    def prepare(*args, **kwargs):
        raise Prepared

    monkeypatch.setattr(module, "prepare_task_data", prepare)
    return module


def detector(tmp_path: Path) -> tuple[Path, str]:
    from models.detector.io import fingerprint_of

    manifest = {"kind": "detector", "files": {"config.json": "c" * 64, "model.safetensors": "d" * 64}}
    folder = tmp_path / "detector"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder, fingerprint_of(manifest)


def run(presets, monkeypatch, tmp_path: Path, folder: Path, *extra: str) -> None:
    monkeypatch.setattr(sys, "argv", ["presets.py", *MAKE_RESULTS, "--detector-dir", str(folder),
                                      "--json", str(tmp_path / "presets.json"), "--results-md",
                                      str(tmp_path / "RESULTS.md"), "--work-dir", str(tmp_path / "runs"), *extra])
    presets.main()


def record(presets, monkeypatch, tmp_path: Path, fingerprint: str) -> None:
    monkeypatch.setattr(sys, "argv", ["presets.py", *MAKE_RESULTS])
    (tmp_path / "presets.json").write_text(json.dumps({"budget": presets.budget(presets.parse_args(), fingerprint),
                                                       "runs": {}}))


def test_results_of_another_detector_are_refused_before_the_data_is_prepared(presets, monkeypatch, tmp_path, capsys):
    folder, fingerprint = detector(tmp_path)
    record(presets, monkeypatch, tmp_path, "c2336d7b0f63f882")
    with pytest.raises(SystemExit) as stop:
        run(presets, monkeypatch, tmp_path, folder)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another budget" in err and "--force" in err
    assert f"detector c2336d7b0f63f882 there, {fingerprint} here" in err and "finetune_steps" not in err


def test_the_same_budget_or_force_goes_on_to_prepare_the_data(presets, monkeypatch, tmp_path):
    folder, fingerprint = detector(tmp_path)
    record(presets, monkeypatch, tmp_path, fingerprint)
    with pytest.raises(Prepared):
        run(presets, monkeypatch, tmp_path, folder)
    record(presets, monkeypatch, tmp_path, "c2336d7b0f63f882")
    with pytest.raises(Prepared):
        run(presets, monkeypatch, tmp_path, folder, "--force")  # what `make results` runs


def test_make_results_replaces_the_recorded_results_as_docs_results_say():
    target = (ROOT / "Makefile").read_text().split("\nresults:", 1)[1].split("\n\n", 1)[0]
    command = target.split("benchmarks/presets.py", 1)[1].split()
    assert command[: len(MAKE_RESULTS)] == MAKE_RESULTS and "--force" in command
    assert "make results" in (ROOT / "docs" / "RESULTS.md").read_text()
