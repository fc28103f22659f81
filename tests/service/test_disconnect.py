"""A client that goes away is not served: its request is cancelled with the work it queued (a batch-mate still gets
its answer, work another request shares goes on for that one), a body cut short never reaches the route, and such a
request is counted as 499 with no answer sent (service/security.py).

The in-process tests drive the app as uvicorn does (security.BodyLimitMiddleware reads the body, then the ASGI
receive channel says http.disconnect when the client goes away) with batch functions held at a gate, so that the
state at the disconnect is known; the last test sends cut bodies to a real `vlserve serve` over TCP."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import subprocess
import sys
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.service.conftest import SCORE_TOL, free_port, metric, wait_until_ready
from tests.service.held_work import DEADLINE_S, Gate, encoder, in_thread, wait_for


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Leaving:
    """One POST sent to the app as uvicorn would present it, by a client that may go away (leave()) before its
    answer; `messages` are what the app sent it."""

    def __init__(self, client: TestClient, path: str, body: dict) -> None:
        data = json.dumps(body).encode()
        self.scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                      "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                      "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                                  (b"content-length", str(len(data)).encode())],
                      "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}
        self.data, self.messages = data, []
        self.left = threading.Event()
        self.done = client.portal.start_task_soon(self._run, client.app)

    async def _run(self, app) -> None:
        body = [{"type": "http.request", "body": self.data, "more_body": False}]

        async def receive():
            if body:
                return body.pop()
            while not self.left.is_set() and not self.answered:  # uvicorn: until the connection is lost
                await asyncio.sleep(0.005)
            return {"type": "http.disconnect"}

        async def send(message):
            self.messages.append(message)

        await app(self.scope, receive, send)

    @property
    def answered(self) -> bool:
        return any(m["type"] == "http.response.body" and not m.get("more_body") for m in self.messages)

    def leave(self) -> None:
        self.left.set()
        self.done.result(DEADLINE_S)  # the app has returned


def test_a_client_gone_cancels_the_batches_its_request_queued(make_settings, image_png):
    """/retrieve of 100 captions: 13 batches; the client goes away while the first runs: the other 12 never run,
    the request is counted 499 and nothing is sent."""
    with TestClient(create_app(make_settings())) as c:
        image_id = c.post("/images", json={"image": b64(image_png)}).json()["image_id"]
        itm = encoder(c, "itm")
        with Gate(itm) as gate:
            request = Leaving(c, "/retrieve", {"image_id": image_id, "texts": [f"a shape number {k}" for k in range(100)]})
            wait_for(lambda: gate.entered == 1 and itm.queue_depth > 0, "the first batch runs, the rest are queued")
            request.leave()
            gate.open()
            assert request.messages == []  # no answer: the client has gone
            r = c.post("/retrieve", json={"image_id": image_id, "texts": ["a red shape", "a blue shape"]})
            assert r.status_code == 200, r.text
            assert gate.rows == [8, 2], "the cancelled request's queued batches ran"
        assert itm.queue_depth == 0
        assert metric(c, "vlserve_requests_total", endpoint="/retrieve", method="POST", status="499") == 1
        assert metric(c, "vlserve_requests_total", endpoint="/retrieve", method="POST", status="200") == 1


def test_a_batch_mate_of_a_cancelled_request_gets_its_answer(make_settings, image_png):
    with TestClient(create_app(make_settings(max_batch_size=4, precision="fp32"))) as c:
        image_id = c.post("/images", json={"image": b64(image_png)}).json()["image_id"]
        body = {"image_id": image_id, "question": "what color is the rectangle?", "top_k": 3}
        vqa = encoder(c, "vqa")
        with Gate(vqa) as gate:
            first, first_out = in_thread(lambda: c.post("/vqa", json=body))  # holds the encoder
            wait_for(lambda: gate.entered == 1, "the first request's batch runs")
            leaving = Leaving(c, "/vqa", body)
            mate, mate_out = in_thread(lambda: c.post("/vqa", json=body))
            wait_for(lambda: vqa.requests_waiting == 2, "both requests are queued behind it")
            gate.release()  # the first batch ends; the two queued requests run together
            wait_for(lambda: gate.entered == 2, "the batch of the two runs")
            assert gate.rows == [1, 2]
            leaving.leave()
            gate.open()
            first.join(DEADLINE_S), mate.join(DEADLINE_S)
        assert leaving.messages == []
        assert first_out["r"].status_code == 200 and mate_out["r"].status_code == 200, mate_out["r"].text
        mine, first = mate_out["r"].json()["answers"], first_out["r"].json()["answers"]  # fp32: equal to rounding
        assert [a["answer"] for a in mine] == [a["answer"] for a in first]
        assert [a["score"] for a in mine] == pytest.approx([a["score"] for a in first], abs=SCORE_TOL["fp32"])
        assert metric(c, "vlserve_requests_total", endpoint="/vqa", method="POST", status="499") == 1
        assert metric(c, "vlserve_requests_total", endpoint="/vqa", method="POST", status="200") == 2


def test_a_detection_goes_on_for_the_request_still_waiting_and_stops_with_the_last(make_settings, make_png):
    """Two requests with the same new image share its detection: the one whose client goes away does not stop it
    for the other. A detection only a gone client waited for is dropped before it runs."""
    with TestClient(create_app(make_settings(detector_max_batch_size=1))) as c:
        regions = c.app.state.services.pipeline.regions
        shared = {"image": b64(make_png(5)), "question": "what color?"}
        with Gate(regions._batcher) as gate:
            leaving = Leaving(c, "/vqa", shared)
            wait_for(lambda: gate.entered == 1, "the image's detection runs")
            staying, staying_out = in_thread(lambda: c.post("/vqa", json=shared))
            wait_for(lambda: _waiters(regions) == 2, "the second request waits for the same detection")
            leaving.leave()
            alone = Leaving(c, "/vqa", {"image": b64(make_png(6)), "question": "what color?"})
            wait_for(lambda: regions._batcher.requests_waiting == 1, "the other image waits for the detector")
            alone.leave()
            gate.open()
            staying.join(DEADLINE_S)
        assert staying_out["r"].status_code == 200, staying_out["r"].text
        assert leaving.messages == [] and alone.messages == []
        assert gate.rows == [1] and regions.detector_runs == 1  # the abandoned image was never detected
        assert metric(c, "vlserve_requests_total", endpoint="/vqa", method="POST", status="499") == 2
        again = c.post("/vqa?timings=true", json={"image": b64(make_png(6)), "question": "what color?"}).json()
        assert again["timings"]["cache_hit"] is False and regions.detector_runs == 2


def _waiters(regions) -> int:
    return sum(work.waiters for work in regions._inflight.values())


BANK = ["a red circle", "two blue squares", "a small yellow rectangle", "nothing here", "three red circles",
        "a large green square", "a blue triangle", "a purple circle"]


@pytest.fixture(scope="module")
def banked(tmp_path_factory, tiny_detector, make_checkpoint):
    return make_checkpoint(tmp_path_factory.mktemp("banked"), tiny_detector.fingerprint,
                           labels_extra={"retrieval_bank": {"texts": BANK, "temperature": 0.5}})


def test_a_client_gone_stops_the_query_bank_work_of_its_request(banked, make_settings, make_png):
    """Text -> images over a new image computes its query-bank prior (4 batches of 2 bank rows here): a client
    that goes away during the first stops the rest, and the prior is computed by the next request."""
    with TestClient(create_app(make_settings(model_dir=banked, max_batch_size=2, query_bank_on_register=False))) as c:
        pipeline = c.app.state.services.pipeline
        image_id = c.post("/images", json={"image": b64(make_png(9))}).json()["image_id"]
        body = {"text": "a red shape", "image_ids": [image_id]}
        with Gate(encoder(c, "itm")) as gate:
            leaving = Leaving(c, "/retrieve", body)
            wait_for(lambda: gate.entered == 1, "the request's own pair runs")
            gate.release()
            wait_for(lambda: gate.entered == 2, "the first batch of bank rows runs")
            leaving.leave()
            gate.open()
            r = c.post("/retrieve", json=body)
        assert leaving.messages == [] and r.status_code == 200, r.text
        assert gate.rows == [1, 2, 1, 2, 2, 2, 2], "the gone request's bank rows went on"
        assert pipeline.bank.computed == 1 and pipeline.bank.known(image_id)


# ---- over TCP: a real `vlserve serve` ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_checkpoint, tiny_detector):
    port, logs = free_port(), tmp_path_factory.mktemp("serve")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLSERVE_")}
    cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--model-dir", str(tiny_checkpoint), "--detector-dir",
           str(tiny_detector.dir), "--port", str(port), "--threads", "1", "--log-level", "warning",
           "--shutdown-drain-s", "0"]
    with (logs / "serve.log").open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_ready(proc, base, (logs / "serve.log").read_text)
            yield port, base, logs / "serve.log"
        finally:
            proc.kill()
            proc.wait()


def send_cut(port: int, body: bytes, sent: int) -> None:
    """POST /vqa declaring all of `body` but sending `sent` bytes of it, then resetting the connection."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        head = (f"POST /vqa HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        s.sendall(head + body[:sent])
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST


def test_a_body_cut_short_by_the_client_is_not_served(served, image_png):
    """Half a JSON body is no 400, and a body that lacks only its trailing padding is no 200: the client went
    away before sending what it declared, so the route never runs; both are counted 499."""
    port, base, log = served
    body = json.dumps({"image": b64(image_png), "question": "what color?"}).encode()
    send_cut(port, body, len(body) // 2)
    padded = body + b" " * 5000
    send_cut(port, padded, len(padded) - 2500)

    def count(status: str) -> float:
        with httpx.Client(base_url=base) as http:
            for line in http.get("/metrics").text.splitlines():
                if line.startswith(f'vlserve_requests_total{{endpoint="/vqa",method="POST",status="{status}"}}'):
                    return float(line.split()[-1])
        return 0.0

    wait_for(lambda: count("499") == 2, "both cut requests are counted 499")
    assert count("400") == 0 and count("200") == 0
    r = httpx.post(f"{base}/vqa", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200 and count("200") == 1
    assert "Traceback" not in log.read_text() and "ERROR" not in log.read_text()
