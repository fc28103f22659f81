"""Admission to the detector (`detector_max_queue_wait_s`): a new image whose detection would wait longer than the
bound behind the images queued ahead gets 429 /problems/queue-full with Retry-After, before its pixels are decoded;
images the feature store holds never touch the detector and are never refused by it."""
from __future__ import annotations

import base64
import threading
import time

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from typer.testing import CliRunner

from service.app import create_app
from service.settings import Settings
from tests.service.conftest import assert_problem
from vlserve.cli import app as cli

SLOW_S = 0.5  # a detector batch (one image) while measuring: sleeps this long, plus the tiny detector's few ms
BOUND_S = 0.8  # detector_max_queue_wait_s: one image queued ahead (about SLOW_S) fits, two (2 x SLOW_S) do not


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def wait_for(condition, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def client(make_settings):
    """One image per detector batch (as the bottom-up-attention detector on a CPU), admission bound BOUND_S."""
    with TestClient(create_app(make_settings(detector_max_batch_size=1, detector_max_queue_wait_s=BOUND_S))) as c:
        yield c


def test_a_new_image_beyond_the_bound_is_refused_before_decoding_and_known_images_are_not(client, make_png):
    regions = client.app.state.services.pipeline.regions
    batcher = regions._batcher
    assert batcher.config.max_queue_wait_ms == BOUND_S * 1000
    run = batcher.fn
    batcher.fn = lambda items: (time.sleep(SLOW_S), run(items))[1]
    known = make_png(seed=1)
    registered = client.post("/images", json={"image": b64(known)})  # the first batch measured replaces warm-up's
    assert registered.status_code == 200, registered.text
    known_id = registered.json()["image_id"]
    assert client.post("/images", json={"image": b64(make_png(seed=2))}).status_code == 200
    measured = batcher._in_flight.batch_seconds  # the detector's batch time: about SLOW_S
    assert SLOW_S <= measured < BOUND_S, f"a detector batch took {measured:.3f} s: the test needs {SLOW_S}..{BOUND_S}"

    decoded: list[int] = []
    decode = regions._decode
    regions._decode = lambda data, pixels: (decoded.append(pixels), decode(data, pixels))[1]
    entered, release = threading.Event(), threading.Event()
    batcher.fn = lambda items: (entered.set(), release.wait(30), run(items))[2]  # holds the detector
    answers: dict[str, object] = {}

    def send(name: str, path: str, body: dict) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.update({name: client.post(path, json=body)}))
        thread.start()
        return thread

    threads = []
    try:
        threads.append(send("running", "/vqa", {"image": b64(make_png(seed=4)), "question": "what color?"}))
        wait_for(entered.is_set, "the first new image reached the detector")
        threads.append(send("queued 1", "/vqa", {"image": b64(make_png(seed=5)), "question": "what color?"}))
        wait_for(lambda: batcher.requests_waiting == 1, "the second new image was admitted")
        threads.append(send("queued 2", "/images", {"image": b64(make_png(seed=6))}))  # one image ahead: fits
        wait_for(lambda: batcher.requests_waiting == 2, "the third new image was admitted")
        before = len(decoded)

        # two images queued ahead at the measured batch time are over the bound: refused, nothing decoded
        refused = client.post("/vqa?timings=true", json={"image": b64(make_png(seed=7)), "question": "what color?"})
        assert_problem(refused, 429, "queue-full")
        assert int(refused.headers["retry-after"]) >= 1 and "X-Request-ID" in refused.headers
        assert_problem(client.post("/images", json={"image": b64(make_png(seed=8))}), 429, "queue-full")
        assert_problem(client.post("/nlvr2", json={"images": [{"image_id": known_id}, {"image": b64(make_png(seed=9))}],
                                                  "statement": "both are red"}), 429, "queue-full")
        v2 = client.post("/v2/models/vlserve-vqa/infer", json={"inputs": [
            {"name": "image", "datatype": "BYTES", "shape": [1], "data": [b64(make_png(seed=10))]},
            {"name": "question", "datatype": "BYTES", "shape": [1], "data": ["what color?"]}]})
        assert v2.status_code == 429 and "error" in v2.json() and int(v2.headers["retry-after"]) >= 1
        assert len(decoded) == before, "a refused image was decoded"
        assert batcher.requests_waiting == 2 and batcher.shed == 4

        # a known image needs no detection: not refused while the detector is over its bound (its encoder batch
        # shares the inference thread with the held detector, so it is answered once that is released)
        threads.append(send("known inline", "/vqa", {"image": b64(known), "question": "what color?"}))
        threads.append(send("known id", "/refer", {"image_id": known_id, "expression": "the red one"}))
        encoders = client.app.state.services.pipeline.batchers
        wait_for(lambda: encoders["vqa"]._running and encoders["refer"]._running,
                 "the known images' requests went to the encoder (waiting for the inference thread)")
        assert "known inline" not in answers and "known id" not in answers
    finally:
        release.set()
        for thread in threads:
            thread.join(30)
        batcher.fn = run
        regions._decode = decode
    assert {name: r.status_code for name, r in answers.items()} == dict.fromkeys(
        ["running", "queued 1", "queued 2", "known inline", "known id"], 200), {n: r.text for n, r in answers.items()}
    assert answers["known inline"].json()["image_id"] == known_id
    assert client.post("/vqa", json={"image": b64(make_png(seed=7)), "question": "what color?"}).status_code == 200


def test_a_requests_new_images_are_admitted_together(client, make_png):
    """/nlvr2 with two new images: both are admitted and queued for the detector at once, not the second only after
    the first's detection (which would let a refusal come after a detection and double the request's wait)."""
    regions = client.app.state.services.pipeline.regions
    batcher = regions._batcher
    run = batcher.fn
    entered, release = threading.Event(), threading.Event()
    batcher.fn = lambda items: (entered.set(), release.wait(30), run(items))[2]  # holds the detector
    answers: dict[str, object] = {}
    threads = [threading.Thread(target=lambda: answers.update(running=client.post(
        "/images", json={"image": b64(make_png(seed=20))})))]
    try:
        threads[0].start()
        wait_for(entered.is_set, "the first new image reached the detector")
        pair = {"images": [{"image": b64(make_png(seed=21))}, {"image": b64(make_png(seed=22))}],
                "statement": "both are red"}
        threads.append(threading.Thread(target=lambda: answers.update(pair=client.post("/nlvr2?timings=true", json=pair))))
        threads[1].start()
        wait_for(lambda: batcher.requests_waiting == 2, "both new images of the /nlvr2 request were queued at once")
    finally:
        release.set()
        for thread in threads:
            thread.join(30)
        batcher.fn = run
    assert answers["running"].status_code == 200 and answers["pair"].status_code == 200, answers["pair"].text
    timings = answers["pair"].json()["timings"]
    assert timings["cache_hit"] is False and timings["regions"] > 0


def test_the_default_bound_takes_a_burst_of_new_images_on_a_fast_detector(make_settings, make_png):
    """The demo detector's few ms a photo (in batches of 8) is never refused at normal loads: a burst of 24 new
    images at once, all answered."""
    with TestClient(create_app(make_settings())) as client:
        batcher = client.app.state.services.pipeline.regions._batcher
        assert batcher.config.max_queue_wait_ms == Settings().detector_max_queue_wait_s * 1000 == 10_000
        bodies = [{"image": b64(make_png(seed=100 + i))} for i in range(24)]  # POST /images: the detector alone
        answers: list = []
        threads = [threading.Thread(target=lambda b=b: answers.append(client.post("/images", json=b))) for b in bodies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(r.status_code for r in answers) == [200] * 24 and batcher.shed == 0


def test_zero_turns_the_detector_bound_off(make_settings):
    with TestClient(create_app(make_settings(detector_max_queue_wait_s=0))) as client:
        assert client.app.state.services.pipeline.regions._batcher.config.max_queue_wait_ms == 0


def test_the_setting_is_validated_and_reaches_the_service(monkeypatch, tmp_path):
    for bad in (-1, float("nan"), "soon"):
        with pytest.raises(ValidationError, match="detector_max_queue_wait_s"):
            Settings(detector_max_queue_wait_s=bad)
    monkeypatch.setenv("VLSERVE_DETECTOR_MAX_QUEUE_WAIT_S", "2.5")
    assert Settings().detector_max_queue_wait_s == 2.5
    result = CliRunner().invoke(cli, ["serve", "--detector-max-queue-wait-s", "-1", "--model-dir", str(tmp_path)])
    assert result.exit_code == 2 and "VLSERVE_DETECTOR_MAX_QUEUE_WAIT_S" in result.output
    assert "Traceback" not in result.output
