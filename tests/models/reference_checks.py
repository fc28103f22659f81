"""What the reference-parity tests of the importers share (test_lxmert_original.py, test_vilbert.py, test_volta.py,
test_vl_bert.py, test_u_visualbert.py): running `vlserve import`, comparing outputs, editing a fixture's state dict,
the full-size key check and the one-line error check. Not a test module."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from typer.testing import CliRunner

from models import VLModel
from models.checkpoint import load_checkpoint
from models.importers.hf_common import HFSource
from service.pipeline import task_specs
from vlserve.cli import app


def run_import(fmt: str, *args: str | Path):
    """`vlserve import FMT ARGS...`, its result."""
    return CliRunner().invoke(app, ["import", fmt, *map(str, args)])


def import_checkpoint(fmt: str, src: Path, out: Path, *options: str | Path):
    """`vlserve import FMT SRC OUT OPTIONS...`, which must succeed, and the checkpoint it wrote."""
    result = run_import(fmt, src, out, *options)
    assert result.exit_code == 0, result.output
    return load_checkpoint(out)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def record(out: Path) -> dict:
    """What the import recorded in the checkpoint's manifest."""
    return json.loads((out / "manifest.json").read_text())["import"]


def served_tasks(ckpt) -> dict:
    return task_specs({t: h.kind for t, h in ckpt.model.config.heads.items()}, {}, ckpt.labels)


# ---- fixture files re-saved, edited --------------------------------------------------------------------------


def resaved(fixture: Path, tmp_path: Path, name: str, edit=None, copied: tuple[str, ...] = (),
            written: dict[str, str] | None = None, save_kwargs: dict | None = None) -> Path:
    """The fixture's `name` re-saved as tmp_path/src/`name` (after `edit` of what the file holds, with torch.save's
    `save_kwargs`), beside the fixture's `copied` files and the `written` ones (file name -> text)."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for f in copied:
        shutil.copy(fixture / f, src / f)
    for f, text in (written or {}).items():
        (src / f).write_text(text)
    data = torch.load(fixture / name, weights_only=True)
    torch.save(edit(data) if edit else data, src / name, **(save_kwargs or {}))
    return src / name



def renamed(old: str, new: str):
    return lambda sd: {k.replace(old, new, 1): v for k, v in sd.items()}


def drop(key: str):
    return lambda sd: {k: v for k, v in sd.items() if k != key}


def add(key: str, value: torch.Tensor):
    return lambda sd: {**sd, key: value}


def halved(src: Path) -> Path:
    """`src` cut to its first half (a truncated download)."""
    src.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    return src


# ---- full size ----------------------------------------------------------------------------------------------


def full_size_source(fixture: Path, shapes: dict[str, list[int]], name: str, config: dict, **fields) -> HFSource:
    """A source `name` (said to be in `fixture`, not there) of the reference's full-size key set `shapes`:
    zero-stride zeros, no memory."""
    zero = torch.zeros(())
    return HFSource(path=fixture / "absent", config=config, state={k: zero.expand(s) for k, s in shapes.items()},
                    weights_file=name, **fields)


def assert_accounted_for(source: HFSource, config, weights: dict[str, torch.Tensor]) -> None:
    """The converted `weights` are exactly the tensors of the model `config` builds (built on the meta device), and
    every source tensor read has the shape the model needs."""
    with torch.device("meta"):
        own = VLModel(config).state_dict()
    source.check_shapes(own)
    assert set(weights) == set(own)
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in own.items()}


# ---- errors -------------------------------------------------------------------------------------------------


def assert_one_line_error(result, out: Path, *messages: str) -> None:
    """Exit code 2, one line `error: ...` holding every message, no traceback, nothing written to `out`."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    assert all(message in result.stderr for message in messages), result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert not out.exists()


def assert_bad_source(cli, tmp_path: Path, make, *messages: str, answers: str = "answers.json") -> None:
    """The source `make(tmp_path)` (with `--answers tmp_path/ANSWERS` where `make` wrote that file) given to `cli`:
    the one-line error holding every message."""
    src = make(tmp_path)
    options = ["--answers", tmp_path / answers] if (tmp_path / answers).exists() else []
    assert_one_line_error(cli(src, tmp_path / "out", *options), tmp_path / "out", *messages)
