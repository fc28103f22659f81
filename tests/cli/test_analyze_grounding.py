"""`vlserve analyze grounding`: where the report cannot be written, and an --examples no split holds, are one line and
exit 2 before the analysis; a write that fails leaves no report file half-written.

The analysis itself is replaced by a stub that records its calls and returns a small report.
"""
import functools
from collections import Counter
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import training.grounding
from training.data.shapes_cache import ShapesConfig
from training.grounding import ENTITY, GroundingTally, summarize, write_report
from vlserve.cli import app

runner = CliRunner()
REPORT_FILES = ("grounding.json", "grounding.md", "grounding.png")


def small_report() -> dict:
    """The report of a 1-layer, 2-head tally: what write_report is given."""
    tally = GroundingTally(layers=1, heads=2, hits={ENTITY: torch.tensor([[2, 1]]), "det": torch.tensor([[0, 1]])},
                           baseline=Counter({ENTITY: 1}), counts=Counter({ENTITY: 2, "det": 1}),
                           reachable=Counter({ENTITY: 2, "det": 1}), region_mass=torch.tensor([[1.0, 0.5]]),
                           text_tokens=4)
    return summarize(tally, model="m", preset="visualbert", split="val", examples=2)


@pytest.fixture
def analysis(tmp_path, monkeypatch):
    """The stubbed analysis: calls[] records each run; `during` (if set) runs inside it, before it returns."""
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    calls, hooks = [], {}

    def analyze_grounding(*args, **kwargs):
        calls.append(args)
        if "during" in hooks:
            hooks["during"]()
        return small_report()

    monkeypatch.setattr(training.grounding, "analyze_grounding", analyze_grounding)
    return calls, hooks


def analyze(models, out: Path, *options):
    det, ckpt = models
    return runner.invoke(app, ["analyze", "grounding", str(ckpt), "--detector-dir", str(det), "--out", str(out),
                               *map(str, options)])


def error_line(result) -> str:
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_the_stubbed_analysis_writes_the_report(models, tmp_path, analysis):
    out = tmp_path / "out"
    result = analyze(models, out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(REPORT_FILES)


@pytest.mark.parametrize("name", REPORT_FILES)
def test_a_report_path_that_is_a_directory_exits_2_before_the_analysis(models, tmp_path, analysis, name):
    calls, _ = analysis
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    line = error_line(analyze(models, out))
    assert line == f"error: --out {out}: {out / name} is a directory; the report writes a file there"
    assert calls == [] and [p.name for p in out.iterdir()] == [name]


def test_a_report_path_that_becomes_a_directory_during_the_analysis_leaves_no_report(models, tmp_path, analysis):
    calls, hooks = analysis
    out = tmp_path / "out"
    hooks["during"] = lambda: (out / "grounding.png").mkdir(parents=True)
    line = error_line(analyze(models, out))
    assert calls and line.startswith(f"error: --out {out}: cannot write the report (") and "grounding.png" in line
    assert [p.name for p in out.iterdir()] == ["grounding.png"]  # no report file, no temporary


def test_a_failed_write_keeps_the_previous_report_whole(tmp_path):
    out = tmp_path / "out"
    paths = write_report(small_report(), out)
    before = {p.name: p.read_bytes() for p in paths.values()}
    paths["png"].unlink()
    paths["png"].mkdir()
    with pytest.raises(IsADirectoryError):
        write_report({**small_report(), "model": "another"}, out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == {
        k: v for k, v in before.items() if k != "grounding.png"}
    assert sorted(p.name for p in out.iterdir()) == sorted(REPORT_FILES)


def test_more_examples_than_the_split_has_scenes_exits_2_before_the_analysis(models, tmp_path, analysis):
    calls, _ = analysis
    line = error_line(analyze(models, tmp_path / "out", "--examples", 99999999999999))
    assert line == "error: --examples 99999999999999: the val split has 2000 scenes, one grounding caption at most each"
    assert calls == [] and not (tmp_path / "out").exists()


def test_grounding_examples_are_of_the_splits_scenes(monkeypatch):
    monkeypatch.setattr(training.grounding, "ShapesConfig",
                        functools.partial(ShapesConfig, splits=(("train", 3), ("val", 3), ("test", 3))))
    with pytest.raises(ValueError, match="4 grounding examples asked of the val split, which has 3 scenes"):
        training.grounding.grounding_examples(4, "val")
    assert [e.row for e in training.grounding.grounding_examples(3, "val")] == [0, 1, 2]
