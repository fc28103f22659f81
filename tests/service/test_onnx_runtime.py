"""The service on VLSERVE_RUNTIME=onnxruntime: the tiny checkpoint exported to a model repository answers every
endpoint as the torch runtime does; the endpoint tests of test_endpoints.py run again on it; GPU providers are
chosen when the build has them; VLSERVE_RUNTIME=tensorrt's engine profiles (its run needs a GPU)."""
from __future__ import annotations

import base64
import logging

import numpy as np
import onnxruntime
import pytest
import torch
from fastapi.testclient import TestClient

from export.encoder import synthetic_batch
from export.repository import export_repository
from models.detector.onnx import OnnxDetector
from models.repository import load_repository
from service.app import StartupError, create_app
from service.runtime.onnx_runtime import CPU, CUDA, TENSORRT, OnnxRuntime, choose_providers, create
from service.runtime.tensorrt_runtime import profile_shapes

# The endpoint tests, re-run on this module's `client` (onnxruntime, in-process store); they are runtime-agnostic.
from tests.service.test_endpoints import (  # noqa: F401
    test_concurrent_requests_share_batches_and_get_their_own_answers,
    test_images_json_and_multipart_agree,
    test_nlvr2_mixes_inline_and_registered_images,
    test_refer_returns_a_region_box_in_pixels,
    test_retrieve_image_to_texts_ranks_captions,
    test_retrieve_text_to_images_ranks_known_images,
    test_vqa_inline_then_by_id_skips_the_detector,
)

PRESETS = ("visualbert", "vl-bert")  # vl-bert reads the detector's whole-image feature: one more graph input


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def repositories(tmp_path_factory, tiny_checkpoint, tiny_detector, make_checkpoint):
    """preset -> (checkpoint dir, exported repository dir), both matched to the tiny detector."""
    out = {}
    for preset in PRESETS:
        ckpt = tiny_checkpoint if preset == "visualbert" else make_checkpoint(
            tmp_path_factory.mktemp(f"ckpt-{preset}"), tiny_detector.fingerprint, preset=preset)
        repo = tmp_path_factory.mktemp(f"repo-{preset}") / "repo"
        export_repository(ckpt, repo, examples=48)
        out[preset] = (ckpt, repo)
    with_detector = tmp_path_factory.mktemp("repo-detector") / "repo"
    export_repository(tiny_checkpoint, with_detector, examples=16, detector_dir=tiny_detector.dir)
    out["with-detector"] = (tiny_checkpoint, with_detector)
    return out


@pytest.fixture(scope="module")
def client(repositories, make_settings):
    """The onnxruntime app on the visualbert repository (the fixture test_endpoints' tests take)."""
    with TestClient(create_app(make_settings(model_dir=repositories["visualbert"][1], runtime="onnxruntime",
                                             max_wait_ms=20.0))) as c:
        c.store = "memory"
        yield c


def answers(c: TestClient, image_png: bytes, make_png) -> dict[str, dict]:
    """One answer per endpoint (both retrieval directions) for fixed inputs."""
    ids = [c.post("/images", json={"image": b64(make_png(seed))}).json()["image_id"] for seed in (51, 52, 53)]
    requests = {
        "vqa": ("/vqa", {"image": b64(image_png), "question": "what color is the rectangle?", "top_k": 5}),
        "refer": ("/refer", {"image": b64(image_png), "expression": "the blue rectangle on the left"}),
        "text_to_images": ("/retrieve", {"text": "a red rectangle", "image_ids": ids, "top_k": 3}),
        "image_to_texts": ("/retrieve", {"image": b64(image_png), "texts": ["a red box", "two blue circles", "sky"],
                                         "top_k": 3}),
        "nlvr2": ("/nlvr2", {"images": [{"image_id": ids[0]}, {"image": b64(image_png)}],
                             "statement": "the left image has more shapes"}),
    }
    out = {}
    for name, (path, body) in requests.items():
        r = c.post(path, json=body)
        assert r.status_code == 200, (name, r.text)
        out[name] = r.json()
    return out


def ranked(items: list[dict], key: str, score: str = "score") -> dict:
    """A ranked list as item -> score, after checking it is ranked best first."""
    scores = [item[score] for item in items]
    assert scores == sorted(scores, reverse=True), items
    return {item[key]: item[score] for item in items}


def assert_same_answers(onnx: dict, ref: dict, tol: float = 1e-5, box_tol: float = 0.0) -> None:
    """The same answers, regions and ranked items with scores within `tol` (float32 rounding by default); boxes within
    `box_tol` pixels (exactly, by default). Items compare by key, so two whose scores tie within `tol` may swap."""
    assert ranked(onnx["vqa"]["answers"], "answer") == pytest.approx(ranked(ref["vqa"]["answers"], "answer"), abs=tol)
    got, want = onnx["refer"], ref["refer"]
    assert ranked([got["region"], *got["runner_up"]], "index") == pytest.approx(
        ranked([want["region"], *want["runner_up"]], "index"), abs=tol)
    box = next(r["box"] for r in [got["region"], *got["runner_up"]] if r["index"] == want["region"]["index"])
    assert box == want["box"] if box_tol == 0 else box == pytest.approx(want["box"], abs=box_tol)
    assert got["score"] == pytest.approx(want["score"], abs=tol)
    for direction, key in (("text_to_images", "image_id"), ("image_to_texts", "index")):
        assert ranked(onnx[direction]["results"], key) == pytest.approx(ranked(ref[direction]["results"], key), abs=tol)
    assert onnx["nlvr2"]["answer"] == ref["nlvr2"]["answer"]
    assert onnx["nlvr2"]["probability"] == pytest.approx(ref["nlvr2"]["probability"], abs=tol)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_endpoint_answers_as_the_torch_runtime(preset, repositories, make_settings, image_png, make_png):
    ckpt, repo = repositories[preset]
    with TestClient(create_app(make_settings(model_dir=ckpt, precision="fp32"))) as c:  # what parity is measured against
        ref = answers(c, image_png, make_png)
    with TestClient(create_app(make_settings(model_dir=repo, runtime="onnxruntime"))) as c:
        model = c.get("/readyz").json()["model"]
        assert model["runtime"] == "onnxruntime" and model["preset"] == preset
        assert len(model["checkpoint"]) == 12  # the source checkpoint's weights, as with torch
        onnx = answers(c, image_png, make_png)
    assert_same_answers(onnx, ref)


def test_a_repository_with_the_detector_serves_it_and_answers_as_torch(repositories, make_settings, image_png, make_png):
    ckpt, repo = repositories["with-detector"]
    exported = load_repository(repo)
    assert exported.detector_path == repo / "detector/detector.onnx" and "detector/detector.onnx" in exported.manifest["files"]
    assert exported.parity["detector"]["features"] <= 1e-4 and exported.parity["detector"]["same_classes"] == 1.0
    with TestClient(create_app(make_settings(model_dir=ckpt, precision="fp32"))) as c:  # what parity is measured against
        ref = answers(c, image_png, make_png)
        torch_fingerprint = c.get("/readyz").json()["model"]["detector"]
    with TestClient(create_app(make_settings(model_dir=repo, runtime="onnxruntime"))) as c:
        assert isinstance(c.app.state.services.pipeline.regions.detector, OnnxDetector)
        assert c.get("/readyz").json()["model"]["detector"] == torch_fingerprint  # same cache keys: same regions
        assert_same_answers(answers(c, image_png, make_png), ref)


def test_bf16_that_changes_nothing_is_said(repositories, make_settings, caplog):
    """--precision bf16 sets torch's arithmetic: under onnxruntime with the repository's own detector graph nothing
    runs in torch, so the setting would silently do nothing."""
    with caplog.at_level(logging.WARNING, logger="vlserve.app"):
        with TestClient(create_app(make_settings(model_dir=repositories["with-detector"][1], runtime="onnxruntime",
                                                 precision="bf16"))) as c:
            assert c.get("/readyz").json()["model"]["precision"] == "fp32"
    assert any("precision bf16 changes nothing here" in r.getMessage() for r in caplog.records)


def test_runtime_batches_equal_torch_logits(repositories, tiny_detector, image_png):
    """Straight through the runtime: padded batches of several rows, with and without image_feature."""
    from models.checkpoint import load_checkpoint
    from service.runtime.torch_runtime import TorchRuntime

    ckpt, repo = repositories["vl-bert"]
    onnx_rt, torch_rt = OnnxRuntime(load_repository(repo), threads=1), TorchRuntime(load_checkpoint(ckpt), threads=1)
    rng = np.random.default_rng(0)
    b, t, n, d = 3, 9, 8, 16
    mask = (np.arange(t) < np.array([[9], [6], [4]])).astype(np.int64)
    rmask = (np.arange(n) < np.array([[8], [5], [2]])).astype(np.int64)
    batch = {"input_ids": rng.integers(1000, 2000, (b, t)) * mask, "attention_mask": mask,
             "token_type_ids": np.zeros((b, t), np.int64), "region_features": rng.random((b, n, d), np.float32),
             "region_boxes": np.tile(np.array([0.1, 0.1, 0.5, 0.6], np.float32), (b, n, 1)), "region_mask": rmask,
             "image_feature": rng.random((b, d), np.float32)}
    for task in ("vqa", "refer", "itm"):
        for keys in (batch, {k: v for k, v in batch.items() if k != "image_feature"}):
            np.testing.assert_allclose(onnx_rt.run(task, keys), torch_rt.run(task, keys), atol=1e-5)
    pair = {k: np.stack([v, v[::-1]], 1) if k.startswith(("region", "image")) else v for k, v in batch.items()}
    np.testing.assert_allclose(onnx_rt.run("nlvr2", pair), torch_rt.run("nlvr2", pair), atol=1e-5)
    with pytest.raises(KeyError, match="no task 'grounding'"):
        onnx_rt.run("grounding", batch)


def test_start_up_names_the_wrong_kind_of_model_directory(repositories, make_settings):
    ckpt, repo = repositories["visualbert"]
    with pytest.raises(StartupError, match="serves a model repository.*vlserve export"):
        with TestClient(create_app(make_settings(model_dir=ckpt, runtime="onnxruntime"))):
            pass
    with pytest.raises(StartupError, match="exported model repository: serve it with VLSERVE_RUNTIME=onnxruntime"):
        with TestClient(create_app(make_settings(model_dir=repo))):
            pass


def test_start_up_refuses_a_repository_for_another_detector(tmp_path, repositories, make_settings, make_detector):
    other = make_detector(tmp_path / "other-detector", seed=7)
    with pytest.raises(StartupError, match="region features of detector"):
        with TestClient(create_app(make_settings(model_dir=repositories["visualbert"][1], runtime="onnxruntime",
                                                 detector_dir=other.dir))):
            pass


def test_create_refuses_a_checkpoint(repositories, make_settings):
    from models.checkpoint import load_checkpoint

    with pytest.raises(ValueError, match="serves a model repository"):
        create(make_settings(runtime="onnxruntime"), load_checkpoint(repositories["visualbert"][0]))


def test_providers_follow_the_device_and_the_build(tmp_path):
    assert choose_providers("cpu", [TENSORRT, CUDA, CPU]) == [CPU]
    chosen = choose_providers("cuda:1", [TENSORRT, CUDA, CPU], engine_cache_dir=tmp_path / "engines")
    assert [p[0] if isinstance(p, tuple) else p for p in chosen] == [TENSORRT, CUDA, CPU]
    assert chosen[0][1]["trt_engine_cache_path"] == str(tmp_path / "engines") and chosen[0][1]["device_id"] == 1
    assert (tmp_path / "engines").is_dir()
    assert [p[0] if isinstance(p, tuple) else p for p in choose_providers("cuda", [CUDA, CPU])] == [CUDA, CPU]
    with pytest.raises(ValueError, match="TensorRT or CUDA execution provider.*onnxruntime-gpu"):
        choose_providers("cuda", [CPU])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not {CUDA, TENSORRT} & set(onnxruntime.get_available_providers()),
                    reason="needs a CUDA GPU and onnxruntime's TensorRT or CUDA execution provider (onnxruntime-gpu)")
def test_gpu_providers_answer_as_the_torch_runtime(repositories, make_settings, image_png, make_png, tmp_path):
    ckpt, repo = repositories["visualbert"]
    with TestClient(create_app(make_settings(model_dir=ckpt, precision="fp32"))) as c:  # what parity is measured against
        ref = answers(c, image_png, make_png)
    with TestClient(create_app(make_settings(model_dir=repo, runtime="onnxruntime", device="cuda",
                                             engine_cache_dir=tmp_path / "trt"))) as c:
        assert_same_answers(answers(c, image_png, make_png), ref)


def test_tensorrt_profiles_cover_the_service_ranges(repositories):
    repo = load_repository(repositories["vl-bert"][1])
    vqa = profile_shapes(repo.graphs["vqa"], max_batch=32, max_text=64)
    assert vqa["trt_profile_min_shapes"].startswith("input_ids:1x1,attention_mask:1x1,")
    assert "input_ids:32x64" in vqa["trt_profile_max_shapes"] and "region_features:32x100x16" in vqa["trt_profile_max_shapes"]
    assert "image_feature:16x16" in vqa["trt_profile_opt_shapes"]
    nlvr2 = profile_shapes(repo.graphs["nlvr2"], max_batch=8, max_text=40)
    assert "region_mask:8x2x100" in nlvr2["trt_profile_max_shapes"] and "region_boxes:1x2x1x4" in nlvr2["trt_profile_min_shapes"]


def test_tensorrt_runtime_says_what_it_needs(repositories, make_settings, monkeypatch):
    from service.runtime import create_runtime

    # as an onnxruntime build without the TensorRT execution provider (the CPU wheel), whatever this one has
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])

    with pytest.raises(ValueError, match="needs a CUDA device .* TensorRT execution provider"):
        create_runtime(make_settings(runtime="tensorrt"), load_repository(repositories["visualbert"][1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or "TensorrtExecutionProvider" not in onnxruntime.get_available_providers(),
                    reason="needs a CUDA GPU and onnxruntime's TensorRT execution provider")
def test_tensorrt_runtime_matches_torch_in_fp16(repositories, tmp_path):
    from models.checkpoint import load_checkpoint
    from service.runtime.tensorrt_runtime import TensorrtRuntime
    from service.runtime.torch_runtime import TorchRuntime

    ckpt, repo = repositories["visualbert"]
    trt = TensorrtRuntime(load_repository(repo), device="cuda", engine_cache_dir=tmp_path, max_batch=4, max_text=16)
    reference = TorchRuntime(load_checkpoint(ckpt), threads=1)
    batch = synthetic_batch(load_repository(repo).config, "vqa", batch=3, text_len=9, regions=8, seed=1)
    np.testing.assert_allclose(trt.run("vqa", batch), reference.run("vqa", batch), atol=5e-2)  # fp16 engines


def test_region_tags_are_fed_and_the_repository_answers_as_torch(tmp_path, tiny_detector, make_checkpoint, make_settings,
                                                                  image_png, make_png):
    """A u-visualbert checkpoint fine-tuned with region tags: both runtimes feed each region its detector class word
    (the same weights served without tags answer otherwise), and the exported repository answers as torch does."""
    tagged = make_checkpoint(tmp_path / "tagged", tiny_detector.fingerprint, preset="u-visualbert", region_tags=True)
    untagged = make_checkpoint(tmp_path / "untagged", tiny_detector.fingerprint, preset="u-visualbert")
    repo = tmp_path / "repo"
    export_repository(tagged, repo, examples=16)
    with TestClient(create_app(make_settings(model_dir=tagged, precision="fp32"))) as c:
        ref = answers(c, image_png, make_png)
    with TestClient(create_app(make_settings(model_dir=untagged, precision="fp32"))) as c:
        plain = answers(c, image_png, make_png)
    with TestClient(create_app(make_settings(model_dir=repo, runtime="onnxruntime"))) as c:
        onnx = answers(c, image_png, make_png)
    assert_same_answers(onnx, ref)
    assert [a["score"] for a in plain["vqa"]["answers"]] != pytest.approx([a["score"] for a in ref["vqa"]["answers"]], abs=1e-4)
