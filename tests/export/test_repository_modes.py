"""A model repository gets the modes the process umask gives ordinary files and directories, its own directory and
the detector's included: it is assembled in a tempfile.mkdtemp directory (0700) renamed into place, and an image
running as another user (uid 10001) must read it when it is mounted."""
from __future__ import annotations

import pytest

from export.repository import export_repository
from models.repository import load_repository
from tests.models.test_file_modes import assert_umask_modes, process_umask, tiny_checkpoint, tiny_detector


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    with process_umask(0o077):  # what the export reads may be private: the repository's modes are the export's umask's
        return tiny_checkpoint(root / "ckpt"), tiny_detector(root / "det")


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_an_exported_repository_has_the_umasks_modes(models, tmp_path, mask):
    checkpoint, detector = models
    with process_umask(mask):
        repo = export_repository(checkpoint, tmp_path / "repo", examples=8, detector_dir=detector)
    assert (repo.path / "detector" / "detector.onnx").is_file() and (repo.path / "graphs" / "vqa.onnx").is_file()
    assert_umask_modes(repo.path, mask)
    load_repository(repo.path)
