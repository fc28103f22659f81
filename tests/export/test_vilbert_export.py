"""The 12-in-1 ViLBERT imported from vilbert-multi-task (tests/fixtures/vilbert) exports to ONNX: the task token of
each head is part of its graph, and every served head matches torch under onnxruntime."""
from __future__ import annotations

from pathlib import Path

from export.encoder import export_task
from export.parity import MAX_ABS_DIFF, SHAPES, measure
from export.repository import runner
from models.checkpoint import load_checkpoint
from models.importers.vilbert import import_vilbert
from models.repository import session

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vilbert"


def test_imported_12_in_1_exports_with_parity(tmp_path):
    import_vilbert(FIXTURE / "multi_task_model.bin", tmp_path / "ckpt", config=FIXTURE / "multi_task_config.json")
    model = load_checkpoint(tmp_path / "ckpt").model.eval()
    assert {h.task_token for h in model.config.heads.values()} == {1, 7, 9, 12, 15}
    for task in ("vqa", "refer", "rank", "nlvr2"):
        spec = export_task(model, task, tmp_path / f"{task}.onnx")
        parity = measure(model, spec, runner(session(tmp_path / f"{task}.onnx")), examples=sum(s[0] for s in SHAPES))
        assert parity.max_abs_diff <= MAX_ABS_DIFF and parity.agreement == 1.0, (task, parity)
