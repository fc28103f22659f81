"""Imported checkpoints export to ONNX: the 12-in-1 ViLBERT from vilbert-multi-task (tests/fixtures/vilbert), whose
task token of each head is part of its graph, and VOLTA's and VL-BERT's, whose position tables (20 and 24 rows)
hold fewer tokens than the longest parity text: every parity batch stays within them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from export.encoder import export_task
from export.parity import MAX_ABS_DIFF, MEASURED_TEXT, SHAPES, measure
from export.repository import runner
from models.checkpoint import load_checkpoint
from models.importers.vilbert import import_vilbert
from models.repository import session
from tests.models.reference_checks import import_checkpoint
from vlserve.cli import app

FIXTURES = Path(__file__).parents[1] / "fixtures"
FIXTURE = FIXTURES / "vilbert"
EXAMPLES = "60"  # past the SHAPES: the batches after them reach texts of 28 tokens


def test_imported_12_in_1_exports_with_parity(tmp_path):
    import_vilbert(FIXTURE / "multi_task_model.bin", tmp_path / "ckpt", config=FIXTURE / "multi_task_config.json")
    model = load_checkpoint(tmp_path / "ckpt").model.eval()
    assert {h.task_token for h in model.config.heads.values()} == {1, 7, 9, 12, 15}
    for task in ("vqa", "refer", "rank", "nlvr2"):
        spec = export_task(model, task, tmp_path / f"{task}.onnx")
        parity = measure(model, spec, runner(session(tmp_path / f"{task}.onnx")), examples=sum(s[0] for s in SHAPES))
        assert parity.max_abs_diff <= MAX_ABS_DIFF and parity.agreement == 1.0, (task, parity)


@pytest.fixture(scope="module")
def volta(tmp_path_factory):
    """VOLTA's fine-tuned ViLBERT (20 positions, 24-d region features, no detector fingerprint recorded)."""
    return import_checkpoint("volta", FIXTURES / "volta" / "pytorch_model_best.bin",
                             tmp_path_factory.mktemp("volta") / "ckpt", "--answers", FIXTURES / "volta" / "label2ans.json")


def export(checkpoint: Path, out: Path, *options: str):
    return CliRunner().invoke(app, ["export", str(checkpoint), "--out", str(out), "--examples", EXAMPLES,
                                    "--threads", "1", *options])


def assert_parity_within_positions(result, out: Path, positions: int) -> None:
    """Exit 0, every graph within the bounds, and the longest parity text is the position table's."""
    assert result.exit_code == 0, result.output
    graphs = json.loads((out / "parity.json").read_text())["graphs"]
    for task, report in graphs.items():
        fp32 = report["fp32"]
        assert fp32["max_abs_diff"] <= MAX_ABS_DIFF and fp32["agreement"] == 1.0, (task, fp32)
        assert max(t for _, t, _ in fp32["shapes"]) == positions < MEASURED_TEXT, (task, fp32["shapes"])


def test_imported_volta_with_few_positions_exports(volta, tmp_path):
    assert volta.model.config.encoder.text_positions == 20
    out = tmp_path / "repo"
    assert_parity_within_positions(export(volta.path, out), out, 20)


def test_imported_vl_bert_exports_within_its_text_positions(tmp_path):
    """VL-BERT's regions and [END] take the two positions after the text: 24 rows place 22 text tokens."""
    checkpoint = import_checkpoint("vl-bert", FIXTURES / "vl_bert" / "vqa.model", tmp_path / "ckpt", "--answers",
                                   FIXTURES / "vl_bert" / "answers_vqa.txt")
    assert checkpoint.model.config.encoder.max_position_embeddings == 24
    out = tmp_path / "repo"
    assert_parity_within_positions(export(checkpoint.path, out), out, 22)


def test_a_detector_of_another_feature_size_is_refused_before_any_graph(volta, tmp_path):
    """The imported checkpoint records no detector fingerprint: the feature size is what can be checked."""
    from tests.service.conftest import build_tiny_detector

    detector = build_tiny_detector(tmp_path / "detector")  # 16-d features; the checkpoint reads 24-d
    result = export(volta.path, tmp_path / "repo", "--detector", str(detector.dir))
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr == (f"error: the checkpoint reads 24-d region features, but {detector.dir} gives 16-d\n")
    assert not (tmp_path / "repo").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["detector"]
