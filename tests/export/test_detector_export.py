"""The detector as one ONNX graph equals the torch detector: boxes, features, classes, attributes and the
whole-image feature, on images of several sizes (none of them the export size) and on blank images."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from export.detector import canonical, detector_parity, export_detector, parity_images
from models.detector.onnx import OnnxDetector
from models.repository import session
from tests.service.conftest import build_tiny_detector, shapes_image

IMAGES = [  # (h, w, seed); the graph was traced on 96 x 128
    (200, 150, 1), (64, 300, 2), (33, 47, 3), (512, 384, 4), (120, 120, 5),
]


def blank(value: int) -> np.ndarray:
    """An image with nothing in it: the detector still ranks its (low-confidence) proposals."""
    return np.full((80, 90, 3), value, np.uint8)


@pytest.mark.parametrize("overrides", [{}, {"adaptive": True, "min_boxes": 2, "max_boxes": 6, "conf_thresh": 0.3},
                                       {"image_feature": False}], ids=["fixed", "adaptive", "no-image-feature"])
def test_exported_detector_equals_torch(overrides, tmp_path):
    detector = build_tiny_detector(tmp_path / "detector", **overrides).detector
    export_detector(detector, tmp_path / "detector.onnx")
    graph = onnx.load(str(tmp_path / "detector.onnx"))
    ops = {n.op_type for n in graph.graph.node}
    assert {"NonMaxSuppression", "RoiAlign"} <= ops  # NMS and RoIAlign are ONNX operators, not unrolled python
    assert [d.dim_param for d in graph.graph.input[0].type.tensor_type.shape.dim[2:]] == ["height", "width"]
    onnx_detector = OnnxDetector(session(tmp_path / "detector.onnx"), detector.config)
    images = [shapes_image(h, w, seed) for h, w, seed in IMAGES] + [blank(128), blank(0)]
    for want, got, image in zip(detector.extract(images), onnx_detector.extract(images), images):
        where = f"image {image.shape}"
        assert got.num_boxes == want.num_boxes and got.boxes.shape == want.boxes.shape, where
        got_rows, want_rows = canonical(got), canonical(want)
        for name, atol in (("boxes", 1e-3), ("features", 1e-4), ("obj_ids", 0), ("attr_ids", 0), ("obj_scores", 1e-5),
                           ("attr_scores", 1e-5)):  # boxes in pixels
            np.testing.assert_allclose(got_rows[name], want_rows[name], atol=atol, err_msg=f"{where}: {name}")
        assert got.image_hw == want.image_hw
        if want.image_feature is None:
            assert got.image_feature is None
        else:
            np.testing.assert_allclose(got.image_feature, want.image_feature, atol=1e-4, err_msg=where)


def test_detector_parity_report(tmp_path):
    detector = build_tiny_detector(tmp_path / "detector").detector
    export_detector(detector, tmp_path / "detector.onnx")
    images = parity_images()
    assert any(im.std() == 0 for im in images) and len({im.shape for im in images}) >= 6
    report = detector_parity(detector, OnnxDetector.load(tmp_path / "detector.onnx", detector.config), images)
    assert report["same_region_count"] == 1.0 and report["same_classes"] == 1.0, report
    assert report["boxes_px"] <= 1e-3 and report["features"] <= 1e-4 and report["image_feature"] <= 1e-4, report
