"""The torch runtime and the detector on a CUDA device (VLSERVE_DEVICE=cuda): every endpoint answers as on the CPU,
in fp32 and in bfloat16, for a one-stream and a two-stream model; the detector's regions on the GPU are the CPU's, and
batching leaves them unchanged there too. Marked gpu: skipped, with the reason, where torch sees no CUDA device."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from models.detector.io import load_detector
from service.app import create_app
from tests.service.conftest import shapes_image
from tests.service.test_onnx_runtime import answers, assert_same_answers, ranked

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")]

PRESETS = ("visualbert", "lxmert")  # lxmert: /retrieve runs on split streams (encode_texts / encode_images / fuse)
# cuDNN's convolutions may use TF32 in the detector, so fp32 on the GPU matches the CPU to about 1e-3, not 1e-5.
FP32_TOL, BOX_TOL = 2e-3, 0.05
BF16_TOL = 3e-2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_checkpoint, tiny_detector, make_checkpoint):
    return {"visualbert": tiny_checkpoint,
            "lxmert": make_checkpoint(tmp_path_factory.mktemp("ckpt-lxmert"), tiny_detector.fingerprint, preset="lxmert")}


def served(settings, image_png, make_png) -> tuple[dict, dict]:
    with TestClient(create_app(settings)) as c:
        ready = c.get("/readyz")
        assert ready.status_code == 200, ready.text
        return ready.json()["model"], answers(c, image_png, make_png)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_endpoint_on_cuda_answers_as_on_the_cpu(preset, checkpoints, make_settings, image_png, make_png):
    _, cpu = served(make_settings(model_dir=checkpoints[preset], precision="fp32"), image_png, make_png)
    model, gpu = served(make_settings(model_dir=checkpoints[preset], precision="fp32", device="cuda"), image_png, make_png)
    assert model["runtime"] == "torch" and model["precision"] == "fp32"
    assert_same_answers(gpu, cpu, tol=FP32_TOL, box_tol=BOX_TOL)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.skipif(not torch.cuda.is_available() or not torch.cuda.is_bf16_supported(),
                    reason="needs a CUDA GPU with bfloat16 arithmetic")
def test_bf16_on_cuda_answers_as_fp32(preset, checkpoints, make_settings, image_png, make_png):
    _, fp32 = served(make_settings(model_dir=checkpoints[preset], precision="fp32", device="cuda"), image_png, make_png)
    model, bf16 = served(make_settings(model_dir=checkpoints[preset], precision="auto", device="cuda"), image_png, make_png)
    assert model["precision"] == "bf16"  # auto picks bfloat16 autocast on a GPU that has it
    # The tiny random model's scores lie close together (its refer scores are all near 1/8), so bfloat16 may reorder
    # them: compare each item's score, and for /refer, which lists only its best few regions, those both list.
    for name, got, ref in zip(("vqa", "refer", "text_to_images", "image_to_texts", "nlvr2"), scores(bf16), scores(fp32)):
        common = got.keys() & ref.keys()
        assert common == ref.keys() or (name == "refer" and common), (name, got, ref)
        assert {k: got[k] for k in common} == pytest.approx({k: ref[k] for k in common}, abs=BF16_TOL), name


def scores(answers: dict) -> list[dict]:
    """Per endpoint answer, item -> score (each list checked to be ranked best first)."""
    refer = answers["refer"]
    return [ranked(answers["vqa"]["answers"], "answer"), ranked([refer["region"], *refer["runner_up"]], "index"),
            ranked(answers["text_to_images"]["results"], "image_id", "probability"),
            ranked(answers["image_to_texts"]["results"], "index", "probability"),
            {"true": answers["nlvr2"]["probability"]}]


def test_the_detector_on_cuda_finds_the_cpu_regions_and_batching_leaves_them(tiny_detector):
    images = [shapes_image(96, 128, seed) for seed in range(3)] + [shapes_image(64, 160, 9)]  # two sizes in one batch
    cpu, _ = load_detector(tiny_detector.dir, device="cpu")
    gpu, _ = load_detector(tiny_detector.dir, device="cuda")
    assert next(gpu.parameters()).is_cuda
    on_cpu, batched = cpu.extract(images), gpu.extract(images, batch_size=4)
    alone = [gpu.extract([image])[0] for image in images]
    for c, b, a in zip(on_cpu, batched, alone):
        assert b.num_boxes == c.num_boxes == a.num_boxes
        np.testing.assert_array_equal(b.obj_ids[: b.num_boxes], c.obj_ids[: c.num_boxes])
        np.testing.assert_allclose(b.boxes, c.boxes, atol=BOX_TOL)
        np.testing.assert_allclose(b.features, c.features, atol=FP32_TOL)
        # batched on the GPU equals one image at a time on the GPU
        np.testing.assert_allclose(b.boxes, a.boxes, atol=1e-4)
        np.testing.assert_allclose(b.features, a.features, atol=1e-4)
