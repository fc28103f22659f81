"""`vlserve export --fp16`: fp16 graphs beside the CPU ones, fp32 inputs and outputs, precision in the manifest,
parity with torch within the fp16 bounds (measured here on onnxruntime's CPU provider, which runs these graphs),
verified like every other file; the onnxruntime runtime serves them only through a CUDA or TensorRT provider."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto

from export.encoder import synthetic_batch
from export.parity import FP16_MAX_ABS_DIFF, FP16_MIN_AGREEMENT, torch_logits
from export.repository import _measure_fp16, export_repository
from models.checkpoint import MANIFEST, load_checkpoint, sha256_file
from models.repository import RepositoryError, load_repository
from service.runtime.onnx_runtime import CPU, CUDA, TENSORRT, OnnxRuntime, choose_graph
from tests.export.test_repository import build_checkpoint, flip_byte

TASKS = {"vqa", "refer", "itm", "nlvr2"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "lxmert")


@pytest.fixture(scope="module")
def repository(checkpoint, tmp_path_factory):
    """fp32 graphs plus fp16 ones, at the default fp16 bounds (5e-2, 99% top-1 agreement)."""
    return export_repository(checkpoint, tmp_path_factory.mktemp("repo") / "repo", fp16=True, examples=200)


def elem_types(values) -> dict[str, int]:
    return {v.name: v.type.tensor_type.elem_type for v in values}


def test_fp16_graphs_sit_beside_the_cpu_graphs_with_their_precision_in_the_manifest(repository):
    manifest = json.loads((repository.path / MANIFEST).read_text())
    assert manifest["fp16"] is True and manifest["precision"] == "fp32" and manifest["format"] == "onnx"
    for task in TASKS:
        entry = manifest["graphs"][task]
        assert entry["file"] == f"graphs/{task}.onnx" and entry["precision"] == "fp32"
        assert entry["fp16"] == {"file": f"graphs/{task}.fp16.onnx", "precision": "fp16", "from": "fp32", "io": "fp32"}
        assert manifest["files"][entry["fp16"]["file"]] == sha256_file(repository.path / entry["fp16"]["file"])
    assert not list(repository.path.rglob("*.fp32.onnx")) and not (repository.path / ".work").exists()


def test_fp16_graphs_keep_the_service_contract_fp32_in_and_out(repository):
    """Same input names and dtypes as the fp32 graph, float32 logits; the weights inside are float16."""
    for task in TASKS:
        half = onnx.load(str(repository.graph_path(task, fp16=True)))
        full = onnx.load(str(repository.graph_path(task)))
        assert elem_types(half.graph.input) == elem_types(full.graph.input)
        assert set(elem_types(half.graph.input).values()) <= {TensorProto.INT64, TensorProto.FLOAT}
        assert elem_types(half.graph.output) == {"logits": TensorProto.FLOAT}
        floats = (TensorProto.FLOAT, TensorProto.FLOAT16)
        weights = [w.data_type for w in half.graph.initializer if w.data_type in floats]
        assert weights.count(TensorProto.FLOAT16) > 0.9 * len(weights), task


def test_fp16_parity_is_measured_here_within_the_fp16_bounds(repository):
    parity = json.loads((repository.path / "parity.json").read_text())
    assert parity["bounds"]["fp16_max_abs_diff"] == FP16_MAX_ABS_DIFF == 5e-2
    assert parity["bounds"]["fp16_min_agreement"] == FP16_MIN_AGREEMENT == 0.99
    on = CUDA if CUDA in onnxruntime.get_available_providers() else CPU
    for task in TASKS:
        report = parity["graphs"][task]
        assert report["fp16_measured_on"] == on, task
        fp16 = report["fp16"]
        assert fp16["examples"] >= 200 and fp16["max_abs_diff"] <= 5e-2 and fp16["agreement"] >= 0.99, (task, fp16)
        assert fp16["max_abs_diff"] > report["fp32"]["max_abs_diff"]  # it is fp16: rounding shows


def test_fp16_from_the_optimized_graph_with_int8_for_cpu(checkpoint, tmp_path):
    """--optimize --quantize int8 --fp16: CPU serves int8, the fp16 graph converts the fused fp32 graph."""
    # random tiny weights give near-tied NLVR2 / ITM logits, which fp16 rounding may flip: a looser agreement bound
    repo = export_repository(checkpoint, tmp_path / "repo", optimize=True, quantize="int8", fp16=True, examples=64,
                             int8_min_agreement=0.5, fp16_min_agreement=0.9)
    assert repo.manifest["precision"] == "int8" and repo.manifest["fp16"] is True
    vqa = repo.manifest["graphs"]["vqa"]
    assert vqa["precision"] == "int8" and vqa["fp16"]["from"] == "optimized"
    ops = {n.op_type for n in onnx.load(str(repo.graph_path("vqa", fp16=True))).graph.node}
    assert {"Attention", "LayerNormalization"} <= ops and "MatMulInteger" not in ops
    for task, report in repo.parity["graphs"].items():
        assert report["fp16"]["max_abs_diff"] <= 5e-2 and report["fp16"]["agreement"] >= 0.9, task


def test_fp16_parity_is_skipped_with_its_reason_where_the_cpu_provider_cannot_run_it(checkpoint, repository,
                                                                                      monkeypatch):
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NoKernel

    def no_kernel(path, threads=1, providers=None, spin=True):
        raise NoKernel("[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for "
                           "LayerNormalization(17) node with name 'ln'\nmore")

    monkeypatch.setattr("export.repository.fp16_providers", lambda: [CPU])
    monkeypatch.setattr("export.repository.session", no_kernel)
    model = load_checkpoint(checkpoint).model.eval()
    parity, report = _measure_fp16(model, repository.graphs["vqa"], repository.graph_path("vqa", fp16=True), 16, 1)
    assert parity is None
    assert report["fp16_parity"].startswith("not measured: onnxruntime's CPU execution provider cannot run the fp16 "
                                            "graph ([ONNXRuntimeError] : 9 : NOT_IMPLEMENTED")
    assert "measured where the CUDA execution provider is" in report["fp16_parity"]


def test_the_onnxruntime_runtime_picks_fp16_only_on_gpu_providers(repository):
    fp32, fp16 = repository.graph_path("vqa"), repository.graph_path("vqa", fp16=True)
    assert choose_graph(repository, "vqa", [CPU]) == fp32
    assert choose_graph(repository, "vqa", [(CUDA, {"device_id": 0}), CPU]) == fp16
    assert choose_graph(repository, "vqa", [(TENSORRT, {"device_id": 0}), (CUDA, {"device_id": 0}), CPU]) == fp16
    without = {task: {k: v for k, v in g.items() if k != "fp16"} for task, g in repository.manifest["graphs"].items()}
    fp32_only = replace(repository, manifest={**repository.manifest, "graphs": without})
    assert choose_graph(fp32_only, "vqa", [(CUDA, {"device_id": 0}), CPU]) == fp32
    with pytest.raises(KeyError, match="no fp16 graph of 'vqa'"):
        fp32_only.graph_path("vqa", fp16=True)


def test_on_cpu_the_runtime_serves_the_fp32_graphs_of_an_fp16_repository(repository, checkpoint):
    runtime = OnnxRuntime(load_repository(repository.path), threads=1)
    assert runtime.graph_files == {task: repository.graph_path(task) for task in TASKS}
    model = load_checkpoint(checkpoint).model.eval()
    batch = synthetic_batch(model.config, "vqa", batch=3, text_len=9, regions=7, seed=5)
    np.testing.assert_allclose(runtime.run("vqa", batch), torch_logits(model, "vqa", batch), atol=1e-5)


@pytest.fixture
def copy(repository, tmp_path):
    return shutil.copytree(repository.path, tmp_path / "repo")


def test_a_tampered_fp16_graph_is_one_error_naming_it(copy):
    flip_byte(copy / "graphs/itm.fp16.onnx", 300)
    with pytest.raises(RepositoryError, match=r"file graphs/itm\.fp16\.onnx does not match its sha256"):
        load_repository(copy)


def test_a_missing_fp16_graph_is_one_error_naming_it(copy):
    (copy / "graphs/refer.fp16.onnx").unlink()
    with pytest.raises(RepositoryError, match=r"missing file graphs/refer\.fp16\.onnx"):
        load_repository(copy)


def test_an_fp16_graph_the_manifest_does_not_hash_is_refused(copy):
    manifest = json.loads((copy / MANIFEST).read_text())
    del manifest["files"]["graphs/nlvr2.fp16.onnx"]
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(RepositoryError, match=r"graphs/nlvr2\.fp16\.onnx is served but has no sha256"):
        load_repository(copy)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or CUDA not in onnxruntime.get_available_providers(),
                    reason="needs a CUDA GPU and onnxruntime's CUDA execution provider (onnxruntime-gpu): the fp16 "
                           "graphs run in fp16 only there")
def test_fp16_graphs_on_the_cuda_provider_match_torch(repository, checkpoint):
    runtime = OnnxRuntime(load_repository(repository.path), device="cuda", threads=1)
    assert runtime.graph_files == {task: repository.graph_path(task, fp16=True) for task in TASKS}
    model = load_checkpoint(checkpoint).model.eval()
    for task in TASKS:
        for seed in range(8):
            batch = synthetic_batch(model.config, task, batch=5, text_len=11, regions=9, seed=seed)
            got, expected = runtime.run(task, batch), torch_logits(model, task, batch)
            assert np.abs(got - expected).max() <= FP16_MAX_ABS_DIFF, task
