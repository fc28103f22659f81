"""Multi-task fine-tuning: a tiny end-to-end run learns, saves and loads; resume reproduces the loss curve."""
import collections
import os

import pytest
import torch
from typer.testing import CliRunner

from models.checkpoint import load_checkpoint
from models.detector import DetectorConfig, RegionDetector
from models.detector.io import save_detector
from training.data.shapes_cache import ShapesConfig
from training.finetune import FinetuneConfig, train
from training.vl_data import prepare_task_data
from vlserve.cli import app

SHAPES = ShapesConfig(splits=(("train", 160), ("val", 80), ("test", 2)))


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    """Regions of 160 + 80 shapes scenes from a small (untrained-head) detector, cached under a temp root."""
    root = tmp_path_factory.mktemp("cache")
    old = os.environ.get("VLSERVE_CACHE")
    os.environ["VLSERVE_CACHE"] = str(root)
    try:
        torch.manual_seed(0)
        cfg = DetectorConfig(classes=["circle", "rectangle", "triangle"], attributes=["red"], min_size=64, max_size=128,
                             rpn_pre_nms_top_n=100, rpn_post_nms_top_n=30, num_boxes=8, feature_dim=16)
        save_detector(RegionDetector(cfg), root / "detector")
        data = prepare_task_data(root / "detector", 160, 80, easy_vqa=False, progress=False, data=SHAPES)
        yield root / "detector", data
    finally:
        if old is None:
            os.environ.pop("VLSERVE_CACHE", None)
        else:
            os.environ["VLSERVE_CACHE"] = old


def tiny(out, detector, **kw) -> FinetuneConfig:
    base = dict(out=out, detector_dir=detector, preset="lxmert", size="tiny", init_text=False, tasks={"vqa": 1.0, "nlvr2": 1.0},
                batch_size=32, lr=2e-3, head_lr=3e-3, warmup=20, eval_every=10_000, threads=1)
    return FinetuneConfig(**{**base, **kw})


def test_tiny_run_trains_saves_loads_and_beats_chance(task_data, tmp_path):
    detector, data = task_data
    result = train(tiny(tmp_path / "enc", detector, steps=300), data=data, progress=False)
    majority = collections.Counter(e.label for e in data.eval["vqa"]).most_common(1)[0][1] / len(data.eval["vqa"])
    assert result["final"]["vqa_acc"] > majority + 0.03, (result["final"], majority)
    assert result["final"]["nlvr2_acc"] > 0.5
    ckpt = load_checkpoint(tmp_path / "enc")
    assert ckpt.labels["heads"]["vqa"] == data.answers
    assert ckpt.manifest["detector"]["fingerprint"] == data.fingerprint
    assert ckpt.manifest["training"]["final"] == result["final"]
    assert not (tmp_path / "enc" / "train_state.pt").exists()


def test_resume_reproduces_the_uninterrupted_loss_curve(task_data, tmp_path):
    detector, data = task_data
    straight = train(tiny(tmp_path / "a", detector, steps=12, tasks={"vqa": 1.0, "refer": 1.0, "itm": 1.0, "nlvr2": 1.0}),
                     data=data, progress=False)["losses"]
    cfg = tiny(tmp_path / "b", detector, steps=12, tasks={"vqa": 1.0, "refer": 1.0, "itm": 1.0, "nlvr2": 1.0})
    first = train(cfg, data=data, progress=False, stop_after=5)
    assert first["interrupted_at"] == 5 and (tmp_path / "b" / "train_state.pt").exists()
    resumed = train(cfg, data=data, progress=False)["losses"]
    assert resumed == pytest.approx(straight, abs=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "resnet"], "unknown preset 'resnet'"),
        (["--size", "huge"], "unknown size 'huge'"),
        (["--tasks", "vqa:1,grounding:1"], "head not supported by fine-tuning: grounding"),
        (["--tasks", "vqa:0"], "task weights must be positive"),
        (["--size", "tiny"], "--init-text needs size small"),
    ],
)
def test_bad_configs_fail_before_training(task_data, tmp_path, args, message):
    detector, _ = task_data
    result = CliRunner().invoke(app, ["train", "finetune", "--out", str(tmp_path / "x"), "--detector", str(detector), *args])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert not (tmp_path / "x").exists()


def test_missing_detector_fails_before_training(tmp_path):
    result = CliRunner().invoke(app, ["train", "finetune", "--out", str(tmp_path / "x"), "--detector", str(tmp_path / "none")])
    assert result.exit_code == 2 and "checkpoint directory not found" in result.stderr
