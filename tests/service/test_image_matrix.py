"""The bad and odd images of benchmarks/fault_cases.py through the app, with a detector of each family (the demo's
and the bottom-up-attention frcnn-vg's, at tiny sizes): each refused with its problem type or accepted with the
size it has once EXIF rotation is applied; never a 5xx. /refer boxes of a rotated photo lie in the rotated frame."""
from __future__ import annotations

import base64
import json

import pytest
from fastapi.testclient import TestClient

from benchmarks.fault_cases import ImageCase, cases, check, exif_rotated
from models.detector.io import fingerprint_of
from service.app import create_app
from tests.models.frcnn_vg_reference import import_fixture
from tests.service.conftest import build_tiny_checkpoint

CASES = list(cases())


@pytest.fixture(scope="module", params=["demo-family", "frcnn-vg"])
def client(request, make_settings, tmp_path_factory):
    settings = {}
    if request.param == "frcnn-vg":
        detector = import_fixture(tmp_path_factory.mktemp("frcnn_vg") / "detector")
        fingerprint = fingerprint_of(json.loads((detector / "manifest.json").read_text()))
        feature_dim = json.loads((detector / "config.json").read_text())["feature_dim"]
        checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"), fingerprint, feature_dim=feature_dim)
        settings = dict(model_dir=checkpoint, detector_dir=detector)
    with TestClient(create_app(make_settings(**settings))) as c:
        yield c


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_image_gets_its_answer_inline_and_as_an_upload(client, case: ImageCase):
    inline = client.post("/images", json={"image": base64.b64encode(case.data).decode()})
    assert check(case, inline.status_code, inline.json(), inline.headers["content-type"]) is None, inline.text
    upload = client.post("/images", files={"file": ("image", case.data, "application/octet-stream")})
    assert check(case, upload.status_code, upload.json(), upload.headers["content-type"]) is None, upload.text


def test_zero_bytes_are_refused_inline_and_as_an_upload(client, problem):
    problem(client.post("/images", json={"image": ""}), 422, "validation-error")
    problem(client.post("/images", files={"file": ("image", b"", "image/png")}), 422, "invalid-image")


def test_refer_boxes_of_a_rotated_photo_lie_in_the_rotated_frame(client):
    r = client.post("/refer", json={"image": base64.b64encode(exif_rotated()).decode(), "expression": "the red one"})
    assert r.status_code == 200, r.text
    body = r.json()
    h, w = body["image_size"]
    assert (h, w) == (160, 90)
    for region in (body["region"], *body["runner_up"]):
        x1, y1, x2, y2 = region["box"]
        assert 0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h, region


def test_the_matrix_covers_what_a_deployment_meets():
    names = " ".join(c.name for c in CASES)
    for kind in ("truncated PNG", "truncated JPEG", "random bytes", "PNG bomb", "GIF bomb", "TIFF bomb", "16-bit",
                 "RGBA", "palette", "CMYK", "EXIF-rotated", "1x1", "10000x20", "animated GIF", "TIFF", "WebP", "SVG",
                 "PDF"):
        assert kind in names, kind
