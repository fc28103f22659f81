"""`vlserve export --format tensorrt` and VLSERVE_RUNTIME=tensorrt's standalone engines.

Here (no GPU, no tensorrt package): the command's one-line refusal (exit 2), the optimisation profiles and their
choice, the start-up checks of an engine repository, and the export's bookkeeping with TensorRT itself
substituted (`substituted_tensorrt`: the "engine" is its source ONNX graph, run by onnxruntime on CPU), so the
manifest, parity report and verification of engines/ are exercised. Building and running real engines is
tested only where TensorRT and a CUDA GPU are (marked gpu, skipped here with the reason).
"""
from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto
from typer.testing import CliRunner

from export import engines
from export.encoder import synthetic_batch
from export.engines import engine_profiles
from export.parity import MEASURED_REGIONS, MEASURED_TEXT, parity_shapes, torch_logits
from export.repository import ExportError, ParityError, export_repository
from models import create_model
from models import engines as engine_runner
from models.checkpoint import MANIFEST, load_checkpoint, save_checkpoint, sha256_file
from models.engines import Ranges, choose_profile
from models.repository import RepositoryError, load_repository
from models.tokenizer import VLTokenizer
from service.runtime.tensorrt_runtime import EngineRuntime, check_engines, create
from tests.export.test_repository import flip_byte
from vlserve.cli import app

GPU_REASON = engine_runner.unavailable()
HERE = {"tensorrt": "11.4.0.106", "device": "Substitute GPU", "compute_capability": "9.0", "typing": "strong"}
SETTINGS = dict(device="cuda", threads=1, engine_cache_dir=None, max_batch_size=32, max_text_tokens=64)


def build_checkpoint(out):
    """A tiny VisualBERT checkpoint with a VQA and a refer head."""
    torch.manual_seed(0)
    heads = {"vqa": {"kind": "vqa", "num_labels": 3}, "refer": {"kind": "refer"}}
    model = create_model("visualbert", "tiny", heads=heads)
    return save_checkpoint(model, out, VLTokenizer.pretrained_minilm(), labels={"heads": {"vqa": ["a", "b", "c"]}},
                           detector={"fingerprint": "0123456789abcdef"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "visualbert")


class SourceGraphEngine:
    """Stands in for models.engines.TensorrtEngine: runs the engine's source graph with onnxruntime on CPU."""

    def __init__(self, path, device="cuda"):
        self.session = onnxruntime.InferenceSession(Path(path).read_bytes(), providers=["CPUExecutionProvider"])

    def run(self, feed):
        return self.session.run(None, feed)[0]

    def close(self):
        pass


def substituted_tensorrt(monkeypatch, typing: str, built: list) -> None:
    """TensorRT replaced for one export: the 'engine' of a graph is the graph it was built from."""
    def build_engine(onnx_path, profiles, workspace_bytes=engines.WORKSPACE_BYTES):
        built.append((onnx.load(str(onnx_path)), profiles))
        return Path(onnx_path).read_bytes()

    monkeypatch.setattr(engine_runner, "unavailable", lambda device="cuda": None)
    monkeypatch.setattr(engine_runner, "environment", lambda device="cuda": {**HERE, "typing": typing})
    monkeypatch.setattr(engines, "build_engine", build_engine)
    monkeypatch.setattr(engine_runner, "TensorrtEngine", SourceGraphEngine)


@pytest.fixture(scope="module", params=["strong", "weak"])
def exported(request, checkpoint, tmp_path_factory):
    """(repository, what build_engine was given) for TensorRT 11 (strongly typed) and TensorRT 10 (FP16 flag)."""
    built = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        substituted_tensorrt(monkeypatch, request.param, built)
        # random tiny weights give near-tied region scores that fp16 rounding may flip: a looser agreement bound
        repo = export_repository(checkpoint, tmp_path_factory.mktemp("repo") / "repo", fmt="tensorrt", examples=48,
                                 fp16_min_agreement=0.9)
    return repo, built


# ---- what this machine gets ----------------------------------------------------------------------------

def export_cli(checkpoint, tmp_path, *options: str):
    return CliRunner().invoke(app, ["export", str(checkpoint), "--out", str(tmp_path / "repo"), *options])


def without_tensorrt(monkeypatch) -> None:
    """This process as on a machine without the tensorrt package (`import tensorrt` fails), GPU or not."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)


def test_format_tensorrt_here_exits_2_with_one_clear_message(checkpoint, tmp_path, monkeypatch):
    without_tensorrt(monkeypatch)
    result = export_cli(checkpoint, tmp_path, "--format", "tensorrt")
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith("error: --format tensorrt builds TensorRT engines on a CUDA GPU, but ")
    assert "Traceback" not in result.output and "export --format onnx here" in lines[0]
    assert "the tensorrt Python package cannot be imported" in lines[0] and "pip install -e '.[gpu]'" in lines[0]
    assert not (tmp_path / "repo").exists()


def test_format_tensorrt_with_the_package_but_no_cuda_device_exits_2(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="11.4.0.106"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = export_cli(checkpoint, tmp_path, "--format", "tensorrt")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "torch sees no CUDA device" in result.output and result.output.count("error:") == 1


def test_engine_ranges_must_hold_the_parity_batches(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_runner, "unavailable", lambda device="cuda": None)
    result = export_cli(checkpoint, tmp_path, "--format", "tensorrt", "--max-text", "16")
    assert result.exit_code == 2 and f"--max-text >= {MEASURED_TEXT}" in result.output


# ---- profiles -----------------------------------------------------------------------------------------

def test_profiles_cover_small_batches_then_every_batch(checkpoint):
    config = load_checkpoint(checkpoint).model.config
    from export.encoder import graph_spec

    vqa = engine_profiles(graph_spec(config, "vqa"), Ranges(max_batch=32, max_text=64, max_regions=100))
    assert len(vqa) == 2
    assert vqa[0]["input_ids"] == ((1, 1), (1, 16), (8, 64)) and vqa[1]["input_ids"] == ((1, 1), (16, 16), (32, 64))
    assert vqa[1]["region_features"] == ((1, 1, 16), (16, 36, 16), (32, 100, 16))
    small = engine_profiles(graph_spec(config, "vqa"), Ranges(max_batch=4))
    assert small[0]["region_mask"] == ((1, 1), (1, 36), (4, 100))
    assert len(engine_profiles(graph_spec(config, "vqa"), Ranges(max_batch=8))) == 1
    heads = {"nlvr2": {"kind": "nlvr2"}, "mc": {"kind": "multiple_choice"}}
    lxmert = create_model("lxmert", "tiny", heads=heads).config
    assert engine_profiles(graph_spec(lxmert, "nlvr2"), Ranges())[1]["region_boxes"] == ((1, 2, 1, 4), (16, 2, 36, 4),
                                                                                        (32, 2, 100, 4))
    assert engine_profiles(graph_spec(lxmert, "mc"), Ranges())[0]["input_ids"] == ((1, 1, 1), (1, 4, 16), (8, 8, 64))


def test_a_batch_runs_on_the_first_profile_that_holds_it(checkpoint):
    from export.encoder import graph_spec

    profiles = engine_profiles(graph_spec(load_checkpoint(checkpoint).model.config, "vqa"), Ranges())
    shapes = lambda b, t, n: {"input_ids": (b, t), "attention_mask": (b, t), "token_type_ids": (b, t),  # noqa: E731
                              "region_features": (b, n, 16), "region_boxes": (b, n, 4), "region_mask": (b, n)}
    assert choose_profile(profiles, shapes(1, 5, 3)) == 0 and choose_profile(profiles, shapes(8, 64, 100)) == 0
    assert choose_profile(profiles, shapes(9, 5, 3)) == 1 and choose_profile(profiles, shapes(32, 64, 100)) == 1
    with pytest.raises(ValueError, match="outside every optimisation profile.*--max-batch / --max-text"):
        choose_profile(profiles, shapes(2, 65, 3))
    with pytest.raises(ValueError, match="outside every optimisation profile"):
        choose_profile(profiles, shapes(33, 5, 3))


def test_measured_sizes_are_the_largest_the_parity_batches_reach():
    shapes = parity_shapes(5000)
    assert max(t for _, t, _ in shapes) == MEASURED_TEXT == 31 and max(n for *_, n in shapes) == MEASURED_REGIONS == 36


# ---- the export's engines, TensorRT substituted --------------------------------------------------------

def test_engines_are_listed_in_the_manifest_with_version_gpu_and_profiles(exported):
    repo, _ = exported
    manifest = json.loads((repo.path / MANIFEST).read_text())
    assert manifest["format"] == "tensorrt" and manifest["kind"] == "onnx-repository"
    trt = manifest["engines"]
    machine = ("tensorrt", "device", "compute_capability")
    assert {k: trt[k] for k in machine} == {k: HERE[k] for k in machine}
    assert trt["precision"] == "fp16" and trt["ranges"] == {"max_batch": 32, "max_text": 64, "max_regions": 100}
    assert set(trt["graphs"]) == {"vqa", "refer"} and repo.engines == trt
    for task, entry in trt["graphs"].items():
        assert entry["file"] == f"engines/{task}.plan" and entry["precision"] == "fp16"
        assert manifest["files"][entry["file"]] == sha256_file(repo.path / entry["file"])
        assert repo.engine_path(task) == repo.path / entry["file"]
        assert [p["input_ids"]["max"] for p in entry["profiles"]] == [[8, 64], [32, 64]]
        assert entry["profiles"][1]["region_features"] == {"min": [1, 1, 16], "opt": [16, 36, 16], "max": [32, 100, 16]}
    assert not (repo.path / ".work").exists() and sorted(p.name for p in (repo.path / "engines").iterdir()) == [
        "refer.plan", "vqa.plan"]


def test_engines_come_from_the_plain_graph_in_the_precision_the_tensorrt_version_needs(exported):
    repo, built = exported
    typing = repo.engines["typing"]
    assert len(built) == 2
    for graph, profiles in built:
        ops = {n.op_type for n in graph.graph.node}
        assert not any(n.domain == "com.microsoft" for n in graph.graph.node)  # TensorRT's parser: standard ops only
        assert [i.name for i in graph.graph.input] == list(profiles[0])  # a profile shape for every input
        weights = {w.data_type for w in graph.graph.initializer}
        if typing == "weak":  # TensorRT 10: the fp32 graph, BuilderFlag.FP16
            assert TensorProto.FLOAT16 not in weights
        else:  # TensorRT 11: the fp16 graph, normalisation kept fp32
            assert TensorProto.FLOAT16 in weights and "LayerNormalization" in ops
            fp32 = {w.name for w in graph.graph.initializer if w.data_type == TensorProto.FLOAT} | {
                n.output[0] for n in graph.graph.node if n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT}
            norms = [n for n in graph.graph.node if n.op_type == "LayerNormalization"]
            assert norms and all(set(n.input) <= fp32 for n in norms)  # data, scale and bias in fp32
    assert {e["built_from"] for e in repo.engines["graphs"].values()} == {
        "weak": {"fp32 graph, BuilderFlag.FP16"},
        "strong": {"fp16 graph (LayerNormalization fp32), strongly typed"}}[typing]


def test_engine_parity_is_in_the_report(exported):
    repo, _ = exported
    report = json.loads((repo.path / "parity.json").read_text())
    assert report["bounds"]["fp16_max_abs_diff"] == 5e-2
    for task in ("vqa", "refer"):
        assert report["engines"][task]["examples"] >= 48 and report["engines"][task]["max_abs_diff"] <= 5e-2


def test_engine_parity_past_the_bound_writes_nothing(checkpoint, tmp_path, monkeypatch):
    substituted_tensorrt(monkeypatch, "strong", [])
    with pytest.raises(ParityError, match=r"graph 'vqa' \(tensorrt\): max abs logit difference .* exceeds 1e-09"):
        export_repository(checkpoint, tmp_path / "repo", fmt="tensorrt", examples=16, fp16_max_abs_diff=1e-9)
    assert not list(tmp_path.iterdir())


def test_an_engine_build_failure_is_an_export_error(checkpoint, tmp_path, monkeypatch):
    substituted_tensorrt(monkeypatch, "weak", [])

    def rejected(onnx_path, profiles, workspace_bytes=0):
        raise engines.EngineBuildError(f"TensorRT's ONNX parser rejected {Path(onnx_path).name}: unsupported op")
    monkeypatch.setattr(engines, "build_engine", rejected)
    with pytest.raises(ExportError, match=r"parser rejected vqa\.fp32\.onnx: unsupported op"):
        export_repository(checkpoint, tmp_path / "repo", fmt="tensorrt", examples=16)
    assert not list(tmp_path.iterdir())


def test_a_tampered_or_missing_engine_is_one_error_naming_it(exported, tmp_path):
    copy = shutil.copytree(exported[0].path, tmp_path / "repo")
    flip_byte(copy / "engines/vqa.plan", 100)
    with pytest.raises(RepositoryError, match=r"file engines/vqa\.plan does not match its sha256"):
        load_repository(copy)
    (copy / "engines/vqa.plan").unlink()
    with pytest.raises(RepositoryError, match=r"missing file engines/vqa\.plan"):
        load_repository(copy)


# ---- VLSERVE_RUNTIME=tensorrt on an engine repository --------------------------------------------------

def test_engines_are_checked_against_this_machine_and_the_service_limits(exported):
    recorded = exported[0].engines
    check_engines(recorded, HERE, max_batch=32, max_text=64)
    with pytest.raises(ValueError, match=r"built by TensorRT 11\.4\.0\.106, this machine has TensorRT 10\.13.*again"):
        check_engines(recorded, {**HERE, "tensorrt": "10.13.0.35"}, 32, 64)
    with pytest.raises(ValueError, match=r"compute capability 9\.0 \(Substitute GPU\), this is 8\.6 \(Other\)"):
        check_engines(recorded, {**HERE, "compute_capability": "8.6", "device": "Other"}, 32, 64)
    with pytest.raises(ValueError, match="VLSERVE_MAX_BATCH_SIZE=64 exceeds the engines' profiles .*--max-batch 64"):
        check_engines(recorded, HERE, 64, 64)
    with pytest.raises(ValueError, match="VLSERVE_MAX_TEXT_TOKENS=128 exceeds .*--max-text 128"):
        check_engines(recorded, HERE, 32, 128)


def test_an_engine_repository_goes_to_the_engine_runtime_which_says_what_it_needs(exported, monkeypatch):
    without_tensorrt(monkeypatch)
    reason = engine_runner.unavailable()
    with pytest.raises(ValueError, match=f"serves this repository's TensorRT engines, but {reason[:30]}"):
        create(types.SimpleNamespace(**SETTINGS), load_repository(exported[0].path))


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"needs TensorRT and a CUDA GPU: {GPU_REASON}")
def test_engines_built_here_serve_as_torch_in_fp16(checkpoint, tmp_path):
    repo = export_repository(checkpoint, tmp_path / "repo", fmt="tensorrt", examples=200,
                             engine_ranges=Ranges(max_batch=16))
    assert repo.engines["tensorrt"] == engine_runner.environment()["tensorrt"]
    runtime = create(types.SimpleNamespace(**{**SETTINGS, "max_batch_size": 16}), repo)
    assert isinstance(runtime, EngineRuntime)
    model = load_checkpoint(checkpoint).model.eval()
    for task in ("vqa", "refer"):
        for b, t, n in ((1, 5, 3), (7, 40, 36), (16, 64, 100)):  # both profiles, up to their largest shapes
            batch = synthetic_batch(model.config, task, batch=b, text_len=t, regions=n, seed=b)
            got, expected = runtime.run(task, batch), torch_logits(model, task, batch)
            assert got.dtype == np.float32 and got.shape == expected.shape
            assert np.abs(got - expected).max() <= 5e-2, (task, b)
    with pytest.raises(ValueError, match="outside every optimisation profile"):
        runtime.run("vqa", synthetic_batch(model.config, "vqa", batch=17, text_len=5, regions=3))
    runtime.close()
