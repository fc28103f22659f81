"""`vlserve import`'s OUT: written whole or not at all. A write that fails partway (a full disk, here a file-size
limit: EFBIG) is one line and exit 2, and leaves OUT byte for byte as it was, a previous import in it included."""
from __future__ import annotations

import json

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # pinned test dependency
from typer.testing import CliRunner

from models.checkpoint import MANIFEST, load_checkpoint
from models.detector.io import load_detector
from vlserve.cli import app

TINY_BERT = dict(vocab_size=30522, hidden_size=32, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
FRCNN = Path(__file__).parents[1] / "fixtures" / "frcnn_vg" / "tiny"
WEIGHTS_LIMIT = 1 << 20  # bytes a file may reach in the limited import: more than config.json, less than the weights


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """save_pretrained of a tiny LxmertForQuestionAnswering and VisualBertForQuestionAnswering (weights ~4 MB)."""
    root = tmp_path_factory.mktemp("src")
    torch.manual_seed(0)
    lx = transformers.LxmertConfig(**TINY_BERT, l_layers=1, r_layers=1, x_layers=1, visual_feat_dim=16, num_qa_labels=3)
    transformers.LxmertForQuestionAnswering(lx).save_pretrained(root / "lxmert")
    vb = transformers.VisualBertConfig(**TINY_BERT, num_hidden_layers=1, visual_embedding_dim=16, num_labels=3)
    transformers.VisualBertForQuestionAnswering(vb).save_pretrained(root / "visualbert")
    return {"hf-lxmert": root / "lxmert", "hf-visualbert": root / "visualbert"}


def frcnn_args(out: Path, *options: str) -> list[str]:
    return ["frcnn-vg", str(FRCNN), str(out), "--objects", str(FRCNN / "objects_vocab.txt"),
            "--attributes", str(FRCNN / "attributes_vocab.txt"), *options]


def cli(*args: str | Path):
    return CliRunner().invoke(app, ["import", *map(str, args)])


def limited_import(*args: str | Path, max_file_bytes: int = WEIGHTS_LIMIT) -> subprocess.CompletedProcess:
    """`vlserve import ARGS` in a process whose files may not grow past max_file_bytes: the weights write fails
    with EFBIG (File too large) partway, as on a full disk. Python ignores SIGXFSZ, so the write raises."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "vlserve.cli", "import", *map(str, args)], capture_output=True,
                          text=True, preexec_fn=limit, env=env, timeout=300)


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under directory, by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_one_line(result: subprocess.CompletedProcess, *messages: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ") or "Traceback" in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(m in lines[0] for m in messages), result.stderr


def assert_no_staging_left(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if p.name.startswith(".")], list(parent.iterdir())


def test_a_failed_weights_write_leaves_no_out(sources, tmp_path):
    out = tmp_path / "fresh"
    result = limited_import("hf-lxmert", sources["hf-lxmert"], out)
    assert_one_line(result, f"{out}: writing the weights failed", "File too large")
    assert not out.exists()
    assert_no_staging_left(tmp_path)


def test_a_failed_forced_import_leaves_the_previous_import_byte_identical(sources, tmp_path):
    out = tmp_path / "good"
    assert cli("hf-visualbert", sources["hf-visualbert"], out).exit_code == 0
    (out / "notes.txt").write_text("the user's own file")
    before = snapshot(out)
    result = limited_import("hf-lxmert", sources["hf-lxmert"], out, "--force")
    assert_one_line(result, "writing the weights failed")
    assert snapshot(out) == before
    assert load_checkpoint(out).model.config.encoder.preset == "visualbert"
    assert_no_staging_left(tmp_path)


def test_a_failed_detector_import_leaves_no_out(tmp_path):
    out = tmp_path / "det"
    result = limited_import(*frcnn_args(out), max_file_bytes=100 << 10)
    assert_one_line(result, f"{out}: writing the weights failed")
    assert not out.exists()
    assert_no_staging_left(tmp_path)


def test_forced_import_replaces_what_it_writes_and_keeps_the_rest(sources, tmp_path):
    out = tmp_path / "out"
    assert cli("hf-visualbert", sources["hf-visualbert"], out).exit_code == 0
    (out / "notes.txt").write_text("the user's own file")
    result = cli("hf-lxmert", sources["hf-lxmert"], out, "--force")
    assert result.exit_code == 0, result.output
    assert f"wrote {out} (LxmertForQuestionAnswering" in result.stdout
    assert load_checkpoint(out).model.config.encoder.preset == "lxmert"
    assert (out / "notes.txt").read_text() == "the user's own file"
    assert_no_staging_left(tmp_path)


def test_detector_import_reads_its_summary_from_out(tmp_path):
    out = tmp_path / "det"
    result = cli(*frcnn_args(out))
    assert result.exit_code == 0, result.output
    _, fingerprint = load_detector(out)
    assert f"wrote {out} (detector {fingerprint}: resnet101-c4, 40 classes" in result.stdout
    counters = json.loads((out / "manifest.json").read_text())["import"]["ignored_keys"]
    assert counters and all(k.endswith(".num_batches_tracked") for k in counters)
    assert f"note: {len(counters)} BatchNorm counters (num_batches_tracked) not imported" in result.stderr
    assert_no_staging_left(tmp_path)


def test_a_move_that_fails_puts_the_previous_files_back(sources, tmp_path, monkeypatch):
    """os.replace fails on manifest.json, the last file moved into OUT: the files moved before it are taken back."""
    out = tmp_path / "good"
    assert cli("hf-visualbert", sources["hf-visualbert"], out).exit_code == 0
    before = snapshot(out)
    replace = os.replace

    def failing_replace(src, dst):
        if Path(src).parent.name == "new" and Path(dst) == out / MANIFEST:  # not the rollback's replace
            raise OSError(28, "No space left on device", str(dst))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    result = cli("hf-lxmert", sources["hf-lxmert"], out, "--force")
    monkeypatch.undo()
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr == f"error: [Errno 28] No space left on device: '{out / MANIFEST}'\n"
    assert snapshot(out) == before
    assert_no_staging_left(tmp_path)


def test_out_an_existing_file_is_named_as_a_file(sources, tmp_path):
    out = tmp_path / "afile"
    out.write_text("not a directory")
    result = cli("hf-lxmert", sources["hf-lxmert"], out)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.stderr == f"error: {out}: is a file, not a directory (OUT is the directory to write)\n"
    assert out.read_text() == "not a directory"


def test_out_below_a_file_is_one_line(sources, tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    out = tmp_path / "afile" / "out"
    result = cli("hf-lxmert", sources["hf-lxmert"], out)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.stderr == f"error: {out}: cannot write there: {out.parent} is a file, not a directory\n"


def test_forced_import_never_replaces_a_directory_of_the_users(sources, tmp_path):
    out = tmp_path / "out"
    (out / "vocab.txt").mkdir(parents=True)
    (out / "vocab.txt" / "mine.txt").write_text("the user's own file")
    before = snapshot(out)
    result = cli("hf-lxmert", sources["hf-lxmert"], out, "--force")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr == f"error: [Errno 21] Is a directory: '{out / 'vocab.txt'}'\n"
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["vocab.txt"]
    assert_no_staging_left(tmp_path)


VILBERT = Path(__file__).parents[1] / "fixtures" / "vilbert"


def test_vilbert_says_once_which_tensors_it_leaves_out_and_why(tmp_path):
    """The unused biOutput.q_dense* tensors: one warning with the reason (they were listed by name, then again by
    reason)."""
    from models.importers.vilbert import WHY_UNUSED

    result = cli("vilbert", VILBERT / "pretrained_model.bin", tmp_path / "out", "--config",
                 VILBERT / "pretrained_config.json")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: 8 source tensors not imported (listed in manifest.json): {WHY_UNUSED['q_dense']}"]


def test_a_repeated_answer_is_counted_in_words_that_agree(sources, tmp_path):
    (tmp_path / "answers.json").write_text(json.dumps(["yes", "no", "yes"]))
    result = cli("hf-visualbert", sources["hf-visualbert"], tmp_path / "out", "--answers", tmp_path / "answers.json")
    assert result.exit_code == 0, result.output
    assert ("warning: 1 answer names more than one output of the vqa head ('yes' at 0, 2); is the answer table the "
            "checkpoint's own?") in result.stderr


def test_frcnn_vg_adaptive_help_names_what_it_replaces():
    help_text = " ".join(cli("frcnn-vg", "--help").output.replace("│", " ").split())
    assert "instead of frcnn-vg's fixed 36" in help_text and "demo" not in help_text
