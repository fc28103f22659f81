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
    assert report["nonfinite"] == 0, report


def regions(boxes, features, scores, image_feature):
    """The fields of RegionFeatures that detector_parity reads, without RegionFeatures' refusal of NaN: the raw
    outputs of a graph as they are compared."""
    from types import SimpleNamespace

    boxes, features, scores = (np.asarray(a, np.float32) for a in (boxes, features, scores))
    n = len(boxes)
    return SimpleNamespace(num_boxes=n, boxes=boxes, features=features, obj_scores=scores, attr_scores=scores,
                           obj_ids=np.arange(n), attr_ids=np.arange(n),
                           image_feature=None if image_feature is None else np.asarray(image_feature, np.float32))


class Fixed:
    def __init__(self, rows):
        self.rows = rows

    def extract(self, images):
        return [self.rows]


CLEAN = dict(boxes=[[0, 0, 10, 10], [5, 5, 20, 20]], features=[[1.0, 2.0], [3.0, 4.0]], scores=[0.9, 0.5],
             image_feature=[0.5, 0.25])


@pytest.mark.parametrize("name, at, value", [
    ("features", (0, 1), np.nan), ("features", (1, 0), np.inf), ("boxes", (1, 2), np.nan),
    ("scores", (1,), -np.inf), ("image_feature", (1,), np.nan)])
@pytest.mark.parametrize("side", ["exported", "torch"])
def test_nan_or_infinite_detector_outputs_on_one_side_fail_parity(name, at, value, side):
    """NaN compares false with any bound: such values are counted in `nonfinite` and fail the check, whichever side
    has them; the differences are taken over the values finite in both."""
    import json

    from export.repository import MAX_ABS_DIFF, _check_detector

    bad = {k: np.array(v, np.float64) for k, v in CLEAN.items()}
    bad[name][at] = value
    torch_rows, graph_rows = regions(**CLEAN), regions(**bad)
    if side == "torch":
        torch_rows, graph_rows = graph_rows, torch_rows
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)  # not tie-prone: every value is compared
    report = detector_parity(Fixed(torch_rows), Fixed(graph_rows), [image])
    assert report["nonfinite"] == 1, report
    assert all(report[k] == 0.0 for k in ("boxes_px", "features", "scores", "image_feature")), report
    json.dumps(report, allow_nan=False)  # the report stays JSON
    assert _check_detector(report, MAX_ABS_DIFF) == ("detector: 1 box, feature or score values are NaN or infinite "
                                                     "where torch's are not, or the reverse")
    clean = detector_parity(Fixed(regions(**CLEAN)), Fixed(regions(**CLEAN)), [image])
    assert clean["nonfinite"] == 0 and _check_detector(clean, MAX_ABS_DIFF) is None, clean
