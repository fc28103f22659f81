"""Long work of one request (a text -> images request computing the query-bank priors of new images, hundreds of rows
a batch at a time) and background work (the priors of images just registered) do not make admission refuse the
lone requests of other users: they may wait behind a running batch, never get 429 (service/batcher.py, bulk and
background items)."""
from __future__ import annotations

import base64
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.service.held_work import DEADLINE_S, Gate, encoder, in_thread, wait_for

# 40 captions: an image's prior is 20 batches of 2 rows here
BANK = [f"{n} {colour} {shape}" for n in ("one", "two", "three", "four", "five")
        for colour in ("red", "blue") for shape in ("circles", "squares", "triangles", "rectangles")]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def banked(tmp_path_factory, tiny_detector, make_checkpoint):
    return make_checkpoint(tmp_path_factory.mktemp("banked-admission"), tiny_detector.fingerprint,
                           labels_extra={"retrieval_bank": {"texts": BANK, "temperature": 0.5}})


class Held(Gate):
    """A Gate that also tells how many calls are waiting at it now, and the first item of each call."""

    def __init__(self, batcher) -> None:
        super().__init__(batcher)
        self.passed, self.firsts, self.items = 0, [], []
        run = self.run

        def counted(items):
            self.passed += 1
            return run(items)

        self.run = counted

    def __enter__(self) -> Held:
        super().__enter__()
        held = self.batcher.fn

        def noted(items):
            self.firsts.append(items[0])
            self.items.extend(items)
            return held(items)

        self.batcher.fn = noted
        return self

    @property
    def held(self) -> int:
        return self.entered - self.passed


def release_one(gate: Held) -> None:
    """Let the call held at the gate go on."""
    passed = gate.passed
    gate.release()
    wait_for(lambda: gate.passed > passed, "the released call went on")


def step_until(gate: Held, done) -> None:
    """Let the held calls through one at a time until done()."""
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, "the work did not finish"
        if gate.held:
            release_one(gate)
        time.sleep(0.002)


def test_a_lone_request_is_served_while_query_bank_work_runs(banked, make_settings, make_png):
    """Strict admission (max_queue_wait_ms ~0: a request that would wait behind any queued batch is refused). While
    a text -> image request computes a new image's prior and another image's prior is computed in the background
    (as after POST /images), a /vqa or an image -> texts request sent while a background batch runs, one at a time,
    is served: the bank rows queued meanwhile are not counted against it."""
    # max_wait_ms: while the runtime is busy a request waits in its batch until it is free, where the test sees it
    settings = make_settings(model_dir=banked, max_batch_size=2, max_queue_wait_ms=0.001, max_wait_ms=10_000,
                             precision="fp32")
    with TestClient(create_app(settings)) as c:
        pipeline = c.app.state.services.pipeline
        known = c.post("/images", json={"image": b64(make_png(1))}).json()["image_id"]
        c.portal.call(pipeline.bank.settle)
        vqa = {"image_id": known, "question": "what color is the circle?"}
        i2t = {"image_id": known, "texts": ["a red circle", "a blue square", "a green triangle"]}
        assert c.post("/vqa", json=vqa).status_code == 200  # a measured batch time to admit by
        itm = encoder(c, "itm")
        with Held(itm) as gate:
            new = c.post("/images", json={"image": b64(make_png(2))}).json()["image_id"]  # its prior: background
            wait_for(lambda: gate.held == 1, "the new image's prior runs in the background")
            other, other_out = in_thread(lambda: c.post("/images", json={"image": b64(make_png(3))}))
            step_until(gate, lambda: not other.is_alive())
            theirs = c.portal.call(pipeline.regions.from_id, other_out["r"].json()["image_id"]).features
            queued, submit = [], itm.submit  # the text -> image request's items (not background ones) not yet run

            def noted(item, background=False, *args, **kwargs):
                if not background:
                    queued.append(item)
                return submit(item, background, *args, **kwargs)

            itm.submit = noted

            def background_runs() -> bool:
                """The batch held at the gate is of the other image's prior, and rows of the text -> image request's
                prior wait behind it (or it is done)."""
                if not gate.held or not np.array_equal(gate.firsts[-1]["region_features"], theirs.astype(np.float32)):
                    return False
                wait_for(lambda: any(all(item is not run for run in gate.items) for item in queued)
                         or not ranked.is_alive(), "rows of the request's prior are queued")
                return ranked.is_alive()

            ranked, ranked_out = in_thread(lambda: c.post("/retrieve", json={"text": "a red circle", "image_ids": [new]}))
            step_until(gate, lambda: 1 in gate.rows)  # the text -> image request's own pair runs; then its bank rows
            probes: list = []
            while True:  # the work one batch at a time
                wait_for(lambda: gate.held or not ranked.is_alive(), "the next batch runs")
                if not ranked.is_alive():
                    break
                if background_runs() and (not probes or not probes[-1][0].is_alive()):
                    body, path, kind = (vqa, "/vqa", "vqa") if len(probes) % 2 == 0 else (i2t, "/retrieve", "itm")
                    before = encoder(c, kind).requests_waiting
                    probes.append(in_thread(lambda body=body, path=path: c.post(path, json=body)))
                    wait_for(lambda: not probes[-1][0].is_alive() or encoder(c, kind).requests_waiting > before,
                             "the probe is answered or queued")
                release_one(gate)
            gate.open()
            for thread, _ in probes:
                thread.join(DEADLINE_S)
        assert other_out["r"].status_code == 200 and ranked_out["r"].status_code == 200, ranked_out["r"].text
        statuses = [out["r"].status_code for _, out in probes]
        assert len(statuses) >= 2 and statuses == [200] * len(statuses), statuses
        assert pipeline.bank.known(new)
