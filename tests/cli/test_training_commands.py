"""`vlserve train | eval | analyze`: a bad --out, cache root or option value is one line and exit 2 before any work, and
--out never writes over a model unless told to (a resumable run's own directory is resumed).

The trainers, the evaluations' data preparation and the grounding analysis are replaced by stubs: a refused command
must never reach them, an accepted one reaches them at once.
"""
import dataclasses
import re
import typing

import pytest
from typer.testing import CliRunner

import training.data.shapes_cache
import training.detector_train
import training.finetune
import training.grounding
import training.pretrain
import training.vl_data
from training.finetune import STATE
from training.run_config import FinetuneConfig, PretrainConfig
from vlserve.cli import app

runner = CliRunner()
TINY = ["--size", "tiny", "--no-init-text"]  # a run the tiny detector and checkpoint fit


class WorkStarted(Exception):
    """Raised by a stub trainer, data preparation or analysis: the command got past its checks."""


@pytest.fixture(autouse=True)
def let_run(tmp_path, monkeypatch):
    """Every expensive entry point raises WorkStarted, or, once named in `succeed`, records its call and returns
    the metrics its command prints."""
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    calls: dict[str, object] = {}
    metrics = {"final": {}, "train_seconds": 0.0, "history": [{}], "val": {}, "fingerprint": "f" * 16}

    def stub(name):
        def run(*args, **kwargs):
            if name not in calls:
                raise WorkStarted(name)
            calls[name] = args[0] if args else kwargs
            return metrics
        return run

    for module, name in [(training.finetune, "train"), (training.pretrain, "pretrain"),
                         (training.detector_train, "train_detector"), (training.grounding, "analyze_grounding"),
                         (training.vl_data, "prepare_eval_data"), (training.data.shapes_cache, "load_split")]:
        monkeypatch.setattr(module, name, stub(name))

    def succeed(name):
        calls[name] = None
        return calls

    return succeed


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def error_line(result) -> str:
    """The one `error: ...` line a refused command writes (exit 2)."""
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def usage_error(result) -> str:
    """A value the option parser refuses (exit 2): its message, out of the box it is drawn in."""
    assert result.exit_code == 2, (result.output, result.exception)
    return " ".join(result.output.replace("│", " ").split())


def commands(det, ckpt, out):
    """Each command that writes --out, as arguments."""
    return {
        "finetune": ["train", "finetune", "--out", out, "--detector", det, *TINY],
        "pretrain": ["train", "pretrain", "--out", out, "--detector", det, *TINY],
        "detector": ["train", "detector", "--out", out],
        "grounding": ["analyze", "grounding", ckpt, "--detector-dir", det, "--out", out],
    }


# --out that cannot be written

@pytest.mark.parametrize("command", ["finetune", "pretrain", "detector", "grounding"])
def test_an_out_that_is_a_file_exits_2_before_any_work(models, tmp_path, command):
    (tmp_path / "afile").write_text("not a directory")
    for out, why in [(tmp_path / "afile", "(it is a file)"),
                     (tmp_path / "afile" / "run", f"({tmp_path / 'afile'} is a file)")]:
        line = error_line(invoke(*commands(*models, out)[command]))
        assert line == f"error: --out {out}: not a writable directory {why}"
    assert (tmp_path / "afile").read_text() == "not a directory"


@pytest.mark.parametrize("command", ["finetune", "pretrain", "detector", "grounding"])
def test_an_out_it_may_not_write_in_exits_2_before_any_work(models, tmp_path, monkeypatch, command):
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkdtemp", refused)  # as in a read-only directory (root may write in any other)
    out = tmp_path / "new" / "run"
    line = error_line(invoke(*commands(*models, out)[command]))
    assert line == f"error: --out {out}: not a writable directory (cannot create it in {tmp_path}: Permission denied)"
    assert not (tmp_path / "new").exists()


# --out that holds a model

def test_finetune_refuses_to_write_over_the_detector_it_reads(models):
    det, _ = models
    manifest = (det / "manifest.json").read_bytes()
    line = error_line(invoke("train", "finetune", "--out", det, "--detector", det, *TINY, "--force"))
    assert line == f"error: --out {det} is the --detector directory the run reads; choose another --out"
    assert (det / "manifest.json").read_bytes() == manifest


def test_finetune_refuses_to_write_over_the_checkpoint_it_starts_from(models):
    det, ckpt = models
    line = error_line(invoke("train", "finetune", "--out", ckpt, "--detector", det, *TINY, "--init-from", ckpt))
    assert line == f"error: --out {ckpt} is the --init-from directory the run reads; choose another --out"


@pytest.mark.parametrize("command", ["finetune", "pretrain", "detector"])
def test_an_out_holding_a_finished_model_is_refused_without_force(models, tmp_path, let_run, command):
    det, ckpt = models
    manifest = (ckpt / "manifest.json").read_bytes()
    line = error_line(invoke(*commands(det, ckpt, ckpt)[command]))
    assert line == (f"error: --out {ckpt} already holds a finished model (manifest.json); choose another --out or "
                    f"pass --force to write over it")
    assert (ckpt / "manifest.json").read_bytes() == manifest
    trainer = {"finetune": "train", "pretrain": "pretrain", "detector": "train_detector"}[command]
    calls = let_run(trainer)
    result = invoke(*commands(det, ckpt, ckpt)[command], "--force")
    assert result.exit_code == 0, result.output
    assert calls[trainer] is not None


@pytest.mark.parametrize("command, trainer", [("finetune", "train"), ("pretrain", "pretrain")])
def test_an_interrupted_run_of_the_command_is_resumed(models, tmp_path, let_run, command, trainer):
    det, ckpt = models
    out = tmp_path / "run"
    out.mkdir()
    (out / STATE).write_bytes(b"an interrupted run's state")
    calls = let_run(trainer)
    result = invoke(*commands(det, ckpt, out)[command])
    assert result.exit_code == 0, result.output
    assert calls[trainer].out == out


def test_the_detector_refuses_an_interrupted_encoder_run(models, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / STATE).write_bytes(b"an interrupted run's state")
    line = error_line(invoke("train", "detector", "--out", out))
    assert line == (f"error: --out {out} holds an interrupted encoder run ({STATE}); choose another --out or pass "
                    f"--force to write over it")


# option values

def float_flags(cls) -> list[str]:
    """The options of `cls`'s float fields (float or float | None)."""
    hints = typing.get_type_hints(cls)
    return [f"--{(f.metadata.get('flag') or f.name).replace('_', '-')}" for f in dataclasses.fields(cls)
            if hints[f.name] in (float, float | None)]


@pytest.mark.parametrize("command, flag", [("finetune", flag) for flag in float_flags(FinetuneConfig)]
                         + [("pretrain", flag) for flag in float_flags(PretrainConfig)]
                         + [("detector", "--lr"), ("detector", "--attribute-weight")])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_every_float_option_must_be_finite(models, tmp_path, command, flag, value):
    said = usage_error(invoke(*commands(*models, tmp_path / "run")[command], flag, value))
    assert f"Invalid value for '{flag}'" in said
    assert f"must be a finite number, not {value}" in said  # nan is not finite, whatever the option's bounds


@pytest.mark.parametrize("command, flag", [("finetune", "--lr"), ("pretrain", "--head-lr"), ("detector", "--lr")])
def test_a_float_option_below_its_minimum_exits_2(models, tmp_path, command, flag):
    said = usage_error(invoke(*commands(*models, tmp_path / "run")[command], flag, "-1"))
    assert f"Invalid value for '{flag}': Input should be greater than or equal to 0" in said


def test_a_task_named_twice_exits_2(models, tmp_path):
    det, _ = models
    line = error_line(invoke("train", "finetune", "--out", tmp_path / "run", "--detector", det, "--tasks", "vqa:1,vqa:2"))
    assert line == "error: --tasks 'vqa:1,vqa:2' names vqa more than once: give each task one weight"


@pytest.mark.parametrize("flag, value, bound", [("--feature-dim", 100_000_000, "16384"), ("--num-boxes", 100_000, "1000")])
def test_detector_sizes_past_their_bounds_exit_2(models, tmp_path, flag, value, bound):
    said = usage_error(invoke("train", "detector", "--out", tmp_path / "run", flag, value))
    assert f"Invalid value for '{flag}'" in said and bound in said


@pytest.mark.parametrize("command", ["finetune", "pretrain", "detector"])
def test_a_negative_seed_exits_2(models, tmp_path, command):
    said = usage_error(invoke(*commands(*models, tmp_path / "run")[command], "--seed", "-1"))
    assert "Invalid value for '--seed': Input should be greater than or equal to 0" in said


@pytest.mark.parametrize("command", ["finetune", "pretrain", "detector", "grounding", "eval encoder", "eval detector"])
def test_more_threads_than_torch_takes_exit_2(models, tmp_path, command):
    det, ckpt = models
    argv = {**commands(det, ckpt, tmp_path / "run"), "eval encoder": ["eval", "encoder", ckpt, "--detector-dir", det],
            "eval detector": ["eval", "detector", det]}[command]
    said = usage_error(invoke(*argv, "--threads", "99999999999"))
    assert "Invalid value for '--threads': Input should be less than or equal to 1024" in said


# the cache root

@pytest.mark.parametrize("command", ["finetune", "pretrain", "detector", "grounding", "eval encoder", "eval detector"])
def test_a_cache_root_that_is_a_file_exits_2_before_any_work(models, tmp_path, monkeypatch, command):
    det, ckpt = models
    (tmp_path / "afile").touch()
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "afile"))
    argv = {**commands(det, ckpt, tmp_path / "run"), "eval encoder": ["eval", "encoder", ckpt, "--detector-dir", det],
            "eval detector": ["eval", "detector", det]}[command]
    line = error_line(invoke(*argv))
    assert line == f"error: VLSERVE_CACHE={tmp_path / 'afile'}: not a writable directory (it is a file)"


@pytest.mark.parametrize("tasks, named", [("vqa:1,bogus:1", "unknown task 'bogus'"),
                                          ("bogus:1,vqa:1,other:2", "unknown tasks 'bogus', 'other'")])
def test_an_unknown_task_is_named_as_a_task_with_the_known_ones(models, tmp_path, tasks, named):
    from training.finetune import TASKS, TRAINING_SETS

    det, _ = models
    line = error_line(invoke("train", "finetune", "--out", tmp_path / "run", "--detector", det, *TINY, "--tasks", tasks))
    assert line == f"error: {named} in --tasks; choose from {', '.join((*TASKS, *TRAINING_SETS))}"


def test_pretrain_eval_examples_help_states_what_the_option_takes():
    """Its default was shown as "(default: all) [default: 2000]", and no value of the option means all."""
    help_text = " ".join(invoke("train", "pretrain", "--help").output.replace("│", " ").split())
    entry = re.search(r"--eval-examples (.*?\[default: \d+\])", help_text)
    assert entry, help_text
    assert "default: all" not in entry[1] and entry[1].endswith("[default: 2000]") and "first N" in entry[1]


@pytest.mark.parametrize("command", ["finetune", "pretrain", "detector"])
def test_a_second_run_on_the_same_out_exits_2_while_the_first_writes(models, tmp_path, command):
    """Two runs on one --out wrote over each other's state (one died renaming the other's train_state.tmp): the
    second is refused while the first holds the lock beside OUT, and runs once it is gone."""
    from models.feature_files import lock_for_writing

    out = tmp_path / "run"
    out.mkdir()
    with lock_for_writing(tmp_path / ".run.lock"):  # the first run, writing
        line = error_line(invoke(*commands(*models, out)[command]))
    assert line == f"error: --out {out}: another run is writing there; wait for it to end, or choose another --out"
    assert isinstance(invoke(*commands(*models, out)[command]).exception, WorkStarted)  # the first run has ended
