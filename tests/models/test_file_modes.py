"""Checkpoint and detector directories get the modes the process umask gives ordinary files and directories (0644 and
0755 under umask 022: readable by the service image's uid 10001 when mounted; 0600 and 0700 under 077), the weights
included, which safetensors' save_file alone makes 0600 whatever the umask."""
from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import pytest
import torch

from models import create_model
from models.checkpoint import WEIGHTS, load_checkpoint, save_checkpoint
from models.detector import DetectorConfig, RegionDetector
from models.detector.io import load_detector, save_detector
from models.file_modes import apply_umask, umask
from models.tokenizer import VLTokenizer

UMASKS = {0o022: (0o644, 0o755), 0o077: (0o600, 0o700), 0o027: (0o640, 0o750)}  # umask -> file mode, directory mode


@contextlib.contextmanager
def process_umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes_under(root: Path) -> dict[str, str]:
    """Relative path ("." for root) -> its permission bits in octal, for root and everything under it."""
    paths = [root, *sorted(root.rglob("*"))]
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.lstat().st_mode)) for p in paths}


def expected_modes(root: Path, mask: int) -> dict[str, str]:
    file_mode, dir_mode = UMASKS[mask]
    paths = [root, *sorted(root.rglob("*"))]
    return {str(p.relative_to(root)): oct(dir_mode if p.is_dir() else file_mode) for p in paths}


def assert_umask_modes(root: Path, mask: int) -> None:
    """Every file and directory of `root` (root included) has the umask's mode; exported for the CLI and export
    tests."""
    assert modes_under(root) == expected_modes(root, mask)


def tiny_checkpoint(out: Path) -> Path:
    torch.manual_seed(0)
    model = create_model("lxmert", "tiny", heads={"vqa": {"kind": "vqa", "num_labels": 2}})
    return save_checkpoint(model, out, VLTokenizer.pretrained_minilm(), labels={"heads": {"vqa": ["yes", "no"]}})


def tiny_detector(out: Path) -> Path:
    """A tiny detector giving the 16-d regions tiny_checkpoint reads."""
    torch.manual_seed(0)
    cfg = DetectorConfig(classes=["circle", "square"], attributes=["red"], min_size=64, max_size=128, num_boxes=8,
                         feature_dim=16)
    save_detector(RegionDetector(cfg), out)
    return out


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_saved_checkpoint_has_the_umasks_modes(tmp_path, mask):
    with process_umask(mask):
        path = tiny_checkpoint(tmp_path / "ckpt")
    assert_umask_modes(path, mask)
    assert stat.S_IMODE((path / WEIGHTS).stat().st_mode) == UMASKS[mask][0]
    load_checkpoint(path)  # still a valid checkpoint


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_saved_detector_has_the_umasks_modes(tmp_path, mask):
    with process_umask(mask):
        path = tiny_detector(tmp_path / "det")
    assert_umask_modes(path, mask)
    load_detector(path)


def test_weights_written_over_old_ones_get_the_umasks_mode(tmp_path):
    """A checkpoint saved again into its directory (training's --force): the new weights replace the old file whole
    (safetensors renames a complete temporary file over it) and take the umask's mode, not the old file's."""
    path = tiny_checkpoint(tmp_path / "ckpt")
    (path / WEIGHTS).chmod(0o600)
    old_inode = (path / WEIGHTS).stat().st_ino
    with process_umask(0o022):
        tiny_checkpoint(path)
    assert stat.S_IMODE((path / WEIGHTS).stat().st_mode) == 0o644
    assert (path / WEIGHTS).stat().st_ino != old_inode  # a new file renamed into place, never rewritten in place
    assert not [p.name for p in path.iterdir() if p.name.startswith(".")]  # no temporary file left beside it


def test_umask_reads_the_process_umask_without_changing_it():
    with process_umask(0o027):
        assert umask() == 0o027
        assert umask() == 0o027


def test_apply_umask_sets_a_tree_and_leaves_links_alone(tmp_path):
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "w.bin").write_bytes(b"x")
    (tree / "sub" / "w.bin").chmod(0o600)
    (tree / "sub").chmod(0o700)
    outside = tmp_path / "outside"
    outside.write_text("not ours")
    outside.chmod(0o600)
    (tree / "link").symlink_to(outside)
    with process_umask(0o027):
        apply_umask(tree)
    assert modes_under(tree) == {".": "0o750", "link": "0o777", "sub": "0o750", "sub/w.bin": "0o640"}
    assert stat.S_IMODE(outside.stat().st_mode) == 0o600  # a link's target is not the tree's
