"""What `vlserve import` and the zoo write has the modes the process umask gives ordinary files and directories
(0644 and 0755 under umask 022, so that the service image's uid 10001 reads a set mounted into it; 0600 and 0700
under 077), OUT itself and the weights included."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # pinned test dependency
from typer.testing import CliRunner

import training.zoo
from tests.cli.test_import_output import TINY_BERT, frcnn_args
from tests.cli.test_zoo import use_tiny_recipe
from tests.models.test_file_modes import assert_umask_modes, process_umask
from vlserve.cli import app


@pytest.fixture(scope="module")
def lxmert_source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("src") / "lxmert"
    torch.manual_seed(0)
    config = transformers.LxmertConfig(**TINY_BERT, l_layers=1, r_layers=1, x_layers=1, visual_feat_dim=16,
                                       num_qa_labels=3)
    transformers.LxmertForQuestionAnswering(config).save_pretrained(root)
    return root


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_an_imported_detector_has_the_umasks_modes(tmp_path, mask):
    out = tmp_path / "models" / "detector"
    with process_umask(mask):
        result = CliRunner().invoke(app, ["import", *frcnn_args(out)])
    assert result.exit_code == 0, result.output
    assert_umask_modes(out.parent, mask)  # OUT, the directory made for it, and every file in OUT
    assert sorted(p.name for p in out.parent.iterdir()) == ["detector"]  # no staging directory left beside OUT


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_an_imported_checkpoint_has_the_umasks_modes(lxmert_source, tmp_path, mask):
    out = tmp_path / "encoder"
    with process_umask(mask):
        result = CliRunner().invoke(app, ["import", "hf-lxmert", str(lxmert_source), str(out)])
    assert result.exit_code == 0, result.output
    assert_umask_modes(out, mask)


def test_a_model_set_of_the_zoo_has_the_umasks_modes(tmp_path, monkeypatch):
    """A tiny recipe built into the zoo under umask 022: every file and directory of the set (detector, encoder, the
    multi-task run it starts from, the card) is readable by other users, as `docker run -v SET:/models:ro` needs."""
    use_tiny_recipe(monkeypatch, tmp_path)
    with process_umask(0o022):
        built = training.zoo.build_zoo("tiny", tmp_path / "root", threads=1, progress=False)
    assert (built / "encoder" / "model.safetensors").is_file() and (built / "detector" / "model.safetensors").is_file()
    assert_umask_modes(built, 0o022)
