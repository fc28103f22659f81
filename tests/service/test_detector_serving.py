"""How the service readies a butd detector: its precision, whether a bfloat16 res5's region choice is settled in
float32, and the feature-store namespace of each form (pods that would cache different regions never share them)."""
from __future__ import annotations

import pytest
import torch

from models.detector.io import load_detector
from service.app import detector_for_serving
from service.runtime.torch_runtime import resolve_precision
from service.settings import Settings
from tests.models.frcnn_vg_reference import image, import_fixture


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return import_fixture(tmp_path_factory.mktemp("frcnn_vg") / "detector")


@pytest.mark.parametrize("precision, settle", [("fp32", True), ("auto", True), ("auto", False)])
def test_each_serving_form_has_its_own_namespace(imported, precision, settle):
    """auto is bf16 on CPUs with native bfloat16 (AVX512-BF16, AMX: every machine kind of this project but
    AVX2-only ones), where settled and unsettled regions may differ; fp32 keeps the fingerprint."""
    detector = load_detector(imported)[0]
    namespace = detector_for_serving(detector, Settings(precision=precision, detector_settle=settle), "fp")
    bf16 = resolve_precision(precision, torch.device("cpu")) == "bf16"
    assert detector.roi_heads.res5[0].conv1.weight.dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert detector.settles_regions == (bf16 and settle)
    assert namespace == ("fp-bf16s" if bf16 and settle else "fp-bf16" if bf16 else "fp")
    (regions,) = detector.extract([image("coffee")])
    assert regions.num_boxes > 0
