"""A checkpoint or detector whose files match their manifest hashes but cannot be read as what they are (not UTF-8,
an empty vocabulary, a file the manifest no longer lists and that is gone) is one line naming the file and exit 2 for
`vlserve info` and `vlserve eval`, never a traceback."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from models.checkpoint import MANIFEST, sha256_file
from tests.service.conftest import build_tiny_checkpoint, build_tiny_detector
from vlserve.cli import app

runner = CliRunner()
BINARY = b"\xff\xfe\x00garbage"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    detector = build_tiny_detector(root / "det")
    return build_tiny_checkpoint(root / "ckpt", detector.fingerprint), detector.dir


def tampered(source: Path, where: Path, name: str, content: bytes | None) -> Path:
    """A copy of `source` with file `name` replaced by `content` (None: deleted and dropped from the manifest), the
    manifest re-hashed to match, so that only reading the file finds the fault."""
    copy = Path(shutil.copytree(source, where / source.name))
    manifest = json.loads((copy / MANIFEST).read_text())
    if content is None:
        (copy / name).unlink()
        del manifest["files"][name]
    else:
        (copy / name).write_bytes(content)
        manifest["files"][name] = sha256_file(copy / name)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


def one_line(result, *parts: str) -> str:
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(part in lines[0] for part in parts), lines[0]
    return lines[0]


CHECKPOINT_FAULTS = {
    "labels not UTF-8": ("labels.json", BINARY, "invalid JSON ('utf-8' codec can't decode"),
    "labels gone": ("labels.json", None, "(No such file or directory)"),
    "config gone": ("config.json", None, "(No such file or directory)"),
    "tokenizer config not UTF-8": ("tokenizer_config.json", BINARY, "'utf-8' codec can't decode"),
    "tokenizer config a list": ("tokenizer_config.json", b"[1]", "must be a JSON object, not list"),
    "vocabulary not UTF-8": ("vocab.txt", BINARY, "not UTF-8 text"),
    "vocabulary empty": ("vocab.txt", b"", "vocabulary lacks [PAD], [UNK], [CLS], [SEP], [MASK]"),
    "vocabulary gone": ("vocab.txt", None, "(No such file or directory)"),
}


@pytest.mark.parametrize("fault", CHECKPOINT_FAULTS)
def test_info_on_a_checkpoint_file_it_cannot_read(models, tmp_path, fault):
    name, content, says = CHECKPOINT_FAULTS[fault]
    ckpt = tampered(models[0], tmp_path, name, content)
    one_line(runner.invoke(app, ["info", str(ckpt)]), str(ckpt / name), says)


@pytest.mark.parametrize("content, says", [(None, "(No such file or directory)"),
                                           (BINARY, "'utf-8' codec can't decode")])
def test_info_on_a_detector_config_it_cannot_read(models, tmp_path, content, says):
    det = tampered(models[1], tmp_path, "config.json", content)
    one_line(runner.invoke(app, ["info", str(det)]), str(det / "config.json"), says)


def test_eval_detector_on_a_config_that_is_gone(models, tmp_path, monkeypatch):
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    det = tampered(models[1], tmp_path, "config.json", None)
    line = one_line(runner.invoke(app, ["eval", "detector", str(det)]))
    assert line == f"error: cannot read {det / 'config.json'} (No such file or directory)"


def test_eval_encoder_on_labels_that_are_not_utf8(models, tmp_path, monkeypatch):
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    ckpt = tampered(models[0], tmp_path, "labels.json", BINARY)
    one_line(runner.invoke(app, ["eval", "encoder", str(ckpt), "--detector-dir", str(models[1])]),
             f"error: {ckpt / 'labels.json'}: invalid JSON ('utf-8' codec can't decode")
