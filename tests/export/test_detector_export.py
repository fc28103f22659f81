"""The detector as one ONNX graph equals the torch detector: boxes, features, classes, attributes and the
whole-image feature, on images of several sizes (none of them the export size) and on blank images."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from export.detector import OnnxDetector, export_detector
from export.repository import session
from tests.service.conftest import build_tiny_detector, shapes_image

IMAGES = [  # (h, w, seed); the graph was traced on 96 x 128
    (200, 150, 1), (64, 300, 2), (33, 47, 3), (512, 384, 4), (120, 120, 5),
]


def canonical(rf):
    """Rows ordered by confidence (to 1e-4), then box. A blank image's proposals are translated copies whose
    confidences differ only by float rounding, so torch and onnxruntime may rank them in either order."""
    n = rf.num_boxes
    order = np.lexsort((*np.round(rf.boxes[:n], 3).T[::-1], -np.round(rf.obj_scores[:n], 4)))
    return {name: getattr(rf, name)[:n][order].astype(np.float32)
            for name in ("boxes", "features", "obj_ids", "attr_ids", "obj_scores", "attr_scores")}


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
