"""Start-up: the port answers while the models load (/healthz 200, /readyz and the task routes 503 not-ready with
Retry-After), a failure while loading still ends `vlserve serve` with its one line and exit 2, and settings that
could not serve (a feature-store bound below one image's regions) are refused then."""
from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import time

import pytest
from fastapi.testclient import TestClient

import service.app
from service.app import StartupError, create_app
from service.feature_store import entry_bytes
from tests.service.conftest import free_port

DEADLINE_S = 60


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
def held_loading(monkeypatch):
    """service.app.load_models waits until the event is set (the loading of a large model, held)."""
    release, load = threading.Event(), service.app.load_models

    def held(settings):
        release.wait(DEADLINE_S)
        return load(settings)

    monkeypatch.setattr(service.app, "load_models", held)
    yield release
    release.set()  # never leave the inference thread waiting


def test_the_port_answers_while_the_models_load(held_loading, make_settings, image_png, problem):
    app = create_app(make_settings(), load_in_background=True)
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        ready = problem(c.get("/readyz"), 503, "not-ready")
        assert c.get("/readyz").headers["retry-after"] == "1" and "loading" in ready["detail"]
        r = c.post("/vqa", json={"image": b64(image_png), "question": "what color?"})
        problem(r, 503, "not-ready")
        assert r.headers["retry-after"] == "1"
        assert c.get("/v2/health/live").status_code == 200 and c.get("/v2/health/ready").status_code == 503
        assert c.get("/metrics").status_code == 200 and "vlserve_ready 0.0" in c.get("/metrics").text
        held_loading.set()
        deadline = time.monotonic() + DEADLINE_S
        while c.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline and app.state.startup_error is None, app.state.startup_error
            time.sleep(0.05)
        assert c.post("/vqa", json={"image": b64(image_png), "question": "what color?"}).status_code == 200


def test_a_loading_failure_in_the_background_is_reported_as_its_one_line(monkeypatch, make_settings, problem):
    def broken(settings):
        raise StartupError("the weights are not there")

    monkeypatch.setattr(service.app, "load_models", broken)
    app = create_app(make_settings(), load_in_background=True)
    with TestClient(app) as c:
        deadline = time.monotonic() + DEADLINE_S
        while app.state.startup_error is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert app.state.startup_error == "the weights are not there"
        problem(c.get("/readyz"), 503, "not-ready")


def test_vlserve_serve_binds_first_and_a_loading_failure_still_exits_2(tmp_path, tiny_checkpoint, tiny_detector):
    """A bound the in-process store cannot meet is found once the detector is loaded, after the port opened: the
    process ends by itself with exit 2 and one line naming the minimum, no traceback."""
    need = entry_bytes(tiny_detector.detector.config.feature_dim, tiny_detector.detector.config.max_regions,
                       tiny_detector.detector.config.image_feature)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLSERVE_")} | {"VLSERVE_CACHE_MAX_BYTES": "1"}
    cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--model-dir", str(tiny_checkpoint), "--detector-dir",
           str(tiny_detector.dir), "--port", str(free_port()), "--threads", "1", "--log-level", "info"]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the service did not stop by itself")
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: VLSERVE_CACHE_MAX_BYTES 1 cannot hold one image's regions: this detector's "
                      f"{tiny_detector.detector.config.max_regions} regions of "
                      f"{tiny_detector.detector.config.feature_dim} features take {need} bytes; set at least {need}"]
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    running = next(i for i, line in enumerate(lines) if "Uvicorn running on" in line)
    assert running < lines.index(errors[0]), "the port opened before loading"


def test_a_cache_bound_below_one_image_is_refused_and_the_minimum_serves(make_settings, tiny_detector, image_png):
    config = tiny_detector.detector.config
    need = entry_bytes(config.feature_dim, config.max_regions, config.image_feature)
    with pytest.raises(StartupError, match=f"VLSERVE_CACHE_MAX_BYTES {need - 1} cannot hold .* set at least {need}$"):
        with TestClient(create_app(make_settings(cache_max_bytes=need - 1))):
            pass
    with TestClient(create_app(make_settings(cache_max_bytes=need))) as c:  # one image fits: it is served by id
        image_id = c.post("/images", json={"image": b64(image_png)}).json()["image_id"]
        r = c.post("/vqa", json={"image_id": image_id, "question": "what color?"})
        assert r.status_code == 200, r.text


def test_swapped_model_and_detector_directories_are_named_so(make_settings, tiny_checkpoint, tiny_detector):
    with pytest.raises(StartupError, match="is not (an encoder checkpoint but a detector directory|a detector directory "
                                           "but an encoder checkpoint .*swapped)"):
        with TestClient(create_app(make_settings(model_dir=tiny_detector.dir, detector_dir=tiny_checkpoint))):
            pass


def test_a_model_no_endpoint_serves_is_refused(make_settings, make_checkpoint, tiny_detector, tmp_path):
    """A checkpoint of only unserved heads (VisualBERT's VCR multiple choice, a bare encoder) was ready, serving
    nothing: every task route a 404."""
    checkpoint = make_checkpoint(tmp_path / "mc", tiny_detector.fingerprint, heads={"vcr": {"kind": "multiple_choice"}})
    with pytest.raises(StartupError, match=r"has no head an endpoint serves \(its heads: vcr \(multiple_choice\)\); "
                                           "/vqa reads a vqa head"):
        with TestClient(create_app(make_settings(model_dir=checkpoint))):
            pass


def test_with_redis_a_local_tier_below_one_image_is_refused_and_0_means_none(make_settings, tiny_detector, redis_url):
    with pytest.raises(StartupError, match="or 0 for no in-process tier in front of Redis"):
        with TestClient(create_app(make_settings(redis_url=redis_url, cache_max_bytes=100))):
            pass
    with TestClient(create_app(make_settings(redis_url=redis_url, cache_max_bytes=0))) as c:
        assert c.get("/readyz").status_code == 200


@pytest.mark.parametrize("given, missing, words", [
    ("model_dir", "detector_dir", "no detector given for the encoder"),
    ("detector_dir", "model_dir", "no encoder given for the detector"),
])
def test_half_a_model_set_names_the_half_that_is_missing(make_settings, tiny_checkpoint, tiny_detector, given, missing,
                                                         words):
    settings = make_settings(**{missing: None})
    with pytest.raises(StartupError) as err:
        create_app(settings)
    message = str(err.value)
    assert message.startswith(f"{words} {getattr(settings, given)}: set VLSERVE_{missing.upper()}")
    assert "\n" not in message and "make zoo" not in message
    assert message.endswith("or give neither directory: `vlserve serve` then serves the demo model set, building it "
                            "on first use")


def test_no_model_at_all_says_vlserve_serve_builds_the_demo_set(make_settings):
    message = service.app.missing_models(make_settings(model_dir=None, detector_dir=None))
    assert message.startswith("no model to serve: set VLSERVE_MODEL_DIR and VLSERVE_DETECTOR_DIR")
    assert "`vlserve serve` with neither: it serves the demo model set, building it on first use" in message


def test_vlserve_serve_with_an_encoder_alone_says_the_detector_is_missing(tmp_path, tiny_checkpoint, monkeypatch):
    from typer.testing import CliRunner

    from vlserve.cli import app as cli

    for name in [n for n in os.environ if n.startswith("VLSERVE_")]:
        monkeypatch.delenv(name)
    result = CliRunner().invoke(cli, ["serve", "--model-dir", str(tiny_checkpoint)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(f"error: no detector given for the encoder {tiny_checkpoint}: "
                                                   "set VLSERVE_DETECTOR_DIR (--detector-dir)"), result.output
