"""Training and evaluation on a CUDA device (`--device cuda`): fine-tuning follows the CPU run's loss curve and
writes a checkpoint the CPU loads and scores the same; resume on the GPU (and from a GPU state on the CPU)
reproduces the loss curve; bfloat16 autocast, pretraining, the detector and `vlserve eval encoder` run there. Marked
gpu: skipped, with the reason, where torch sees no CUDA device."""
from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from models.checkpoint import load_checkpoint
from models.detector.io import load_detector
from training.detector_train import DetectorTrainConfig, train_detector
from training.evaluate import evaluate_tasks
from training.finetune import train
from training.pretrain import pretrain
from vlserve.cli import app
from tests.training.test_detector_train import SMALL, TINY
from training.vl_data import prepare_task_data
from tests.training.test_finetune import SHAPES, task_data, tiny  # noqa: F401 (a fixture)
from tests.training.test_pretrain import data, detector_dir  # noqa: F401 (fixtures)
from tests.training.test_pretrain import tiny as tiny_pretrain

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")]

EVERY_TASK = {"vqa": 1.0, "refer": 1.0, "itm": 1.0, "nlvr2": 1.0, "multiple_choice": 1.0}


def test_finetuning_on_cuda_follows_the_cpu_run_and_saves_a_checkpoint_the_cpu_scores_the_same(task_data, tmp_path):  # noqa: F811
    detector, tables = task_data
    # no dropout: the two devices draw their masks from different generators
    runs = {d: train(tiny(tmp_path / d, detector, steps=80, dropout=0.0, tasks=EVERY_TASK, device=d), data=tables,
                     progress=False) for d in ("cpu", "cuda")}
    cpu, gpu = runs["cpu"], runs["cuda"]
    assert gpu["device"].startswith("cuda (") and cpu["device"] == "cpu"
    # float32 both (no TF32 for matmuls by default): the same first steps to rounding, then near each other
    assert gpu["losses"][:10] == pytest.approx(cpu["losses"][:10], rel=1e-3, abs=1e-4)
    assert sum(gpu["losses"][-20:]) / 20 == pytest.approx(sum(cpu["losses"][-20:]) / 20, rel=0.1)
    assert sum(gpu["losses"][-20:]) < 0.9 * sum(gpu["losses"][:20])  # it learns
    ckpt = load_checkpoint(tmp_path / "cuda")
    assert {p.device.type for p in ckpt.model.parameters()} == {"cpu"}
    rescored = evaluate_tasks(ckpt.model, tables, ckpt.tokenizer)
    for name, value in gpu["final"].items():  # the GPU's evaluation, repeated on the CPU from the saved weights
        assert rescored[name] == pytest.approx(value, abs=0.02), name
    on_gpu = evaluate_tasks(ckpt.model.to("cuda"), tables, ckpt.tokenizer)
    assert on_gpu == pytest.approx(rescored, abs=0.02)


def test_resume_on_cuda_reproduces_the_loss_curve_and_a_gpu_state_resumes_on_the_cpu(task_data, tmp_path):  # noqa: F811
    detector, tables = task_data
    straight = train(tiny(tmp_path / "a", detector, steps=12, tasks=EVERY_TASK, device="cuda"), data=tables, progress=False)
    cfg = tiny(tmp_path / "b", detector, steps=12, tasks=EVERY_TASK, device="cuda")
    assert train(cfg, data=tables, progress=False, stop_after=5)["interrupted_at"] == 5
    resumed = train(cfg, data=tables, progress=False)  # dropout 0.1: the GPU generator's state is resumed too
    assert resumed["losses"] == pytest.approx(straight["losses"], abs=1e-4)
    # a state written on the GPU goes on on the CPU (no dropout, so the generators do not matter)
    whole = train(tiny(tmp_path / "c", detector, steps=12, dropout=0.0, tasks=EVERY_TASK, device="cuda"), data=tables,
                  progress=False)
    train(tiny(tmp_path / "d", detector, steps=12, dropout=0.0, tasks=EVERY_TASK, device="cuda"), data=tables,
          progress=False, stop_after=5)
    moved = train(tiny(tmp_path / "d", detector, steps=12, dropout=0.0, tasks=EVERY_TASK, device="cpu"), data=tables,
                  progress=False)
    assert moved["device"] == "cpu"
    assert moved["losses"] == pytest.approx(whole["losses"], rel=1e-3, abs=1e-4)
    assert moved["final"] == pytest.approx(whole["final"], abs=0.05)


@pytest.mark.skipif(not torch.cuda.is_available() or not torch.cuda.is_bf16_supported(),
                    reason="needs a CUDA GPU with bfloat16 arithmetic")
def test_bf16_autocast_on_cuda_trains_and_evaluates_in_bf16(task_data, tmp_path):  # noqa: F811
    detector, tables = task_data
    result = train(tiny(tmp_path / "bf16", detector, steps=60, bf16=True, device="cuda"), data=tables, progress=False)
    assert result["train_precision"] == "bf16" and result["eval_precision"] == "bf16"
    assert all(math.isfinite(x) for x in result["losses"])
    assert sum(result["losses"][-10:]) < sum(result["losses"][:10])


@pytest.mark.parametrize("preset", ["lxmert", "u-visualbert"])
def test_pretraining_on_cuda_runs_every_objective_and_resumes(preset, detector_dir, data, tmp_path):  # noqa: F811
    straight = pretrain(tiny_pretrain(tmp_path / "a", detector_dir, preset=preset, steps=8, device="cuda"), data=data,
                        progress=False)
    assert all(math.isfinite(x) for x in straight["losses"])
    assert {p.device.type for p in load_checkpoint(tmp_path / "a", preset=preset).model.parameters()} == {"cpu"}
    cfg = tiny_pretrain(tmp_path / "b", detector_dir, preset=preset, steps=8, device="cuda")
    assert pretrain(cfg, data=data, progress=False, stop_after=3)["interrupted_at"] == 3
    resumed = pretrain(cfg, data=data, progress=False)["records"]
    for a, b in zip(resumed, straight["records"]):
        assert a == pytest.approx(b, abs=1e-4)


def test_the_detector_trains_on_cuda_and_loads_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    metrics = train_detector(DetectorTrainConfig(out=tmp_path / "det", steps=3, batch_size=2, warmup=1, eval_every=10,
                                                 final_eval_images=4, threads=1, data=SMALL, detector=TINY,
                                                 device="cuda"), progress=False)
    assert 0.0 <= metrics["val"]["map50"] <= 1.0 and metrics["val"]["images"] == 4
    detector, fingerprint = load_detector(tmp_path / "det")
    assert fingerprint == metrics["fingerprint"]
    assert {p.device.type for p in detector.parameters()} == {"cpu"}


def test_regions_extracted_on_cuda_are_the_cpus(task_data, tmp_path, monkeypatch):  # noqa: F811
    detector, _ = task_data
    tables = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / device))  # each extracts into a cache of its own
        tables[device] = prepare_task_data(detector, 24, 8, easy_vqa=False, progress=False, data=SHAPES,
                                           device=device).train_table
    cpu, gpu = tables["cpu"], tables["cuda"]
    assert (gpu.mask == cpu.mask).all()  # as many regions per image
    # the same regions in the same order, but for near-tied scores of this untrained detector that may swap
    same = (abs(gpu.boxes - cpu.boxes).max(-1) < 0.01) & (cpu.mask == 1)
    assert same.sum() >= 0.9 * cpu.mask.sum()
    # boxes within 0.01 pool slightly other pixels: features (about 1 in size) within a few hundredths (an H200: 0.022)
    diff = abs(gpu.features[same].astype("float32") - cpu.features[same].astype("float32"))
    assert diff.max() < 0.05 and diff.mean() < 0.01


def test_eval_encoder_on_cuda_scores_as_on_the_cpu(task_data, tmp_path, monkeypatch):  # noqa: F811
    detector, tables = task_data
    train(tiny(tmp_path / "enc", detector, steps=30, tasks=EVERY_TASK), data=tables, progress=False)
    import training.vl_data as vl_data

    monkeypatch.setattr(vl_data, "prepare_eval_data", lambda *a, **k: tables)  # the fixture's regions, not a new split
    results = {}
    for device in ("cpu", "cuda"):
        result = CliRunner().invoke(app, ["eval", "encoder", str(tmp_path / "enc"), "--detector-dir", str(detector),
                                          "--split", "val", "--retrieval-pool", "0", "--device", device])
        assert result.exit_code == 0, result.output
        results[device] = json.loads(result.stdout)
    assert results["cuda"]["device"] == "cuda"
    scores = {k: v for k, v in results["cpu"].items() if k.endswith("_acc")}
    assert scores and {k: results["cuda"][k] for k in scores} == pytest.approx(scores, abs=0.01)
