"""Decoding bounded in memory: the pixel budget, reduced decodes of large images, memory returned after a burst."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient
from PIL import Image, ImageDraw

import service.regions as regions_module
from models.detector.preprocess import decode_side
from models.images import decode_image, header_pixels
from service.app import create_app
from service.batcher import BatcherConfig
from service.feature_store import InProcessStore
from service.regions import PixelBudget
from tests.service.test_regions import serve

CONFIG = BatcherConfig(max_batch_size=4, max_wait_ms=5, max_queue=64)
ROOT = Path(__file__).resolve().parents[2]


def big_png(w: int, h: int, tag: int = 0) -> bytes:
    """A pale w x h PNG with a red rectangle and a blue circle (a few hundred KB even at 40 Mpx); `tag` goes
    into a tEXt chunk, so images that look alike still have distinct bytes (distinct image ids)."""
    img = Image.new("RGB", (w, h), (240, 240, 240))
    draw = ImageDraw.Draw(img)
    draw.rectangle([w * 0.1, h * 0.1, w * 0.45, h * 0.5], fill=(200, 30, 30))
    draw.ellipse([w * 0.55, h * 0.5, w * 0.95, h * 0.9], fill=(30, 30, 200))
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return with_tag(buf.getvalue(), tag)


def with_tag(png: bytes, tag: int) -> bytes:
    body = b"vlserve-test\x00" + str(tag).encode()
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    return png[:-12] + chunk + png[-12:]  # before IEND


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) IoU of x1, y1, x2, y2 boxes."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), -1)
    area = lambda z: np.prod(z[:, 2:] - z[:, :2], -1)  # noqa: E731
    return inter / (area(a)[:, None] + area(b)[None] - inter)


def run_service(tiny_detector, body, **options):
    """Run `body(service)` against a started RegionService on an in-process store."""
    return serve(tiny_detector, lambda fp: InProcessStore(1 << 24, fp), body, 40_000_000, **options)


class DecodeSpy:
    """Wraps the real decode_bounded: the most pixels (from the headers) that were being decoded at one time."""

    def __init__(self, monkeypatch) -> None:
        self.real = regions_module.decode_bounded
        self.lock = threading.Lock()
        self.now = self.peak = self.calls = 0
        monkeypatch.setattr(regions_module, "decode_bounded", self)

    def __call__(self, data, max_pixels, max_side):
        pixels = header_pixels(data, max_pixels, max_side)
        with self.lock:
            self.now += pixels
            self.peak = max(self.peak, self.now)
            self.calls += 1
        try:
            return self.real(data, max_pixels, max_side)
        finally:
            with self.lock:
                self.now -= pixels


def test_the_budget_bounds_the_pixels_decoded_at_once(tiny_detector, monkeypatch):
    spy = DecodeSpy(monkeypatch)
    images = [big_png(1500, 1200, tag=i) for i in range(8)]  # 1.8 Mpx each, reduced to 256 x 205 for the detector
    budget = 4_000_000  # room for two decodes at a time

    async def body(service):
        results = await asyncio.gather(*(service.from_bytes(d) for d in images))
        return results, service.budget.in_use, service.budget.waiting

    results, in_use, waiting = run_service(tiny_detector, body, max_pixels_in_flight=budget, reduced_decoding=True)
    assert spy.calls == 8 and len({image_id for image_id, _, _ in results}) == 8
    assert spy.peak <= budget, f"{spy.peak} pixels were decoded at once, over the budget of {budget}"
    assert spy.peak >= 2 * 1500 * 1200, "two images fit the budget: they decode side by side"
    assert in_use == 0 and waiting == 0, "every reservation was returned"
    assert all(rf.image_hw == (1200, 1500) and rf.num_boxes > 0 for _, rf, _ in results)


def test_an_image_larger_than_the_budget_decodes_alone(tiny_detector, monkeypatch):
    spy = DecodeSpy(monkeypatch)
    images = [big_png(1500, 1200, tag=i) for i in range(3)]

    async def body(service):
        return await asyncio.gather(*(service.from_bytes(d) for d in images))

    results = run_service(tiny_detector, body, max_pixels_in_flight=1_000_000, reduced_decoding=True)
    assert len(results) == 3 and spy.peak == 1500 * 1200  # one at a time, none refused


def test_pixel_budget_is_first_come_first_served_and_survives_cancellation():
    async def main():
        budget = PixelBudget(10)
        assert await budget.acquire(6) == 6
        big = asyncio.create_task(budget.acquire(8))  # waits: 6 + 8 > 10
        await asyncio.sleep(0)
        small = asyncio.create_task(budget.acquire(2))  # would fit now, but queues behind the big one
        gone = asyncio.create_task(budget.acquire(3))
        await asyncio.sleep(0)
        assert not big.done() and not small.done() and budget.in_use == 6
        gone.cancel()
        await asyncio.sleep(0)
        budget.release(6)
        assert await big == 8 and await small == 2 and budget.in_use == 10
        assert budget.waiting == 0 and gone.cancelled()
        budget.release(10)
        assert await budget.acquire(50) == 10  # more than the capacity: cut to it, never stuck
        budget.release(10)
        assert budget.in_use == 0

    asyncio.run(main())


def test_reduced_decoding_keeps_boxes_and_image_size_in_the_original_frame(tiny_detector, monkeypatch):
    detector = tiny_detector.detector
    seen: list[tuple[int, ...]] = []
    real_extract = detector.extract

    def extract(images, batch_size=8):
        seen.extend(im.shape for im in images)
        return real_extract(images, batch_size)

    monkeypatch.setattr(detector, "extract", extract)
    data = big_png(2400, 1600)

    async def body(service):
        return (await service.from_bytes(data))[1]

    rf = run_service(tiny_detector, body, max_pixels_in_flight=8_000_000, reduced_decoding=True)
    side = decode_side(detector.config)
    assert seen == [(round(side * 1600 / 2400), side, 3)], "the detector was given the reduced image"
    assert rf.image_hw == (1600, 2400)
    boxes = rf.boxes[: rf.num_boxes]
    assert boxes.min() >= 0 and (boxes[:, [0, 2]] <= 2400).all() and (boxes[:, [1, 3]] <= 1600).all()
    (full,) = real_extract([decode_image(data)])
    assert full.num_boxes == rf.num_boxes
    best = iou(full.boxes[: full.num_boxes], boxes).max(1)
    assert best.min() > 0.9, f"boxes of the full-size decode without a close box in the reduced one: {best}"
    assert boxes[:, 2].max() > 1200 and boxes[:, 3].max() > 800, "boxes span the original frame, not the reduced one"


def test_images_that_fit_give_bit_identical_regions(tiny_detector, make_png):
    side = decode_side(tiny_detector.detector.config)
    images = [make_png(seed=3), make_png(seed=4, h=side // 2, w=side)]  # the second exactly at the bound

    async def body(service):
        return [(await service.from_bytes(d))[1] for d in images]

    got = run_service(tiny_detector, body, max_pixels_in_flight=1_000_000, reduced_decoding=True)
    for data, rf in zip(images, got):
        (want,) = tiny_detector.detector.extract([decode_image(data)])
        want = want.to_float16()
        assert rf.image_hw == want.image_hw and rf.num_boxes == want.num_boxes
        for name in ("boxes", "features", "obj_ids", "obj_scores", "attr_ids", "attr_scores", "image_feature"):
            assert np.array_equal(getattr(rf, name), getattr(want, name)), name


def test_settings_reach_the_service_and_refer_answers_in_original_pixels(make_settings):
    data = big_png(2400, 1600)
    body = {"image": base64.b64encode(data).decode(), "expression": "the red rectangle"}
    answers = {}
    for reduced in (True, False):
        settings = make_settings(decode_max_pixels_in_flight=5_000_000, decode_reduced=reduced)
        with TestClient(create_app(settings)) as client:
            regions = client.app.state.services.pipeline.regions
            assert regions.budget.capacity == 5_000_000
            assert regions.max_decode_side == (decode_side(regions.detector.config) if reduced else None)
            registered = client.post("/images", json={"image": body["image"]}).json()
            answers[reduced] = client.post("/refer", json=body).json()
        assert registered["image_size"] == [1600, 2400]
        assert answers[reduced]["image_size"] == [1600, 2400]
    box_reduced, box_full = (np.array([answers[r]["box"]], np.float32) for r in (True, False))
    assert iou(box_reduced, box_full)[0, 0] > 0.9, (box_reduced, box_full)
    with TestClient(create_app(make_settings(decode_max_pixels_in_flight=0))) as client:
        assert client.app.state.services.pipeline.regions.budget is None


# ---- resident memory of a burst, measured in a child process ------------------------------------------------

CHILD = r"""
import asyncio, io, json, struct, sys, threading, time, zlib
sys.path.insert(0, sys.argv[1])
import torch
from PIL import Image, ImageDraw
from models.detector import DetectorConfig, RegionDetector
from service.batcher import BatcherConfig
from service.feature_store import InProcessStore
from service.regions import RegionService
from tests.service.conftest import TINY_DETECTOR
from tests.service.test_decode_memory import big_png, with_tag

budget, reduced, n, side = int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)
torch.manual_seed(0)
detector = RegionDetector(DetectorConfig(**TINY_DETECTOR), pretrained_backbone=False).eval()
png = big_png(side, side)
images = [with_tag(png, i) for i in range(n)]
del png

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

async def main():
    store = InProcessStore(1 << 24, "fp")
    service = RegionService(detector, "fp", store, BatcherConfig(8, 5, 64), 40_000_000,
                            max_pixels_in_flight=budget, reduced_decoding=reduced)
    await service.start()
    await service.from_bytes(big_png(200, 150, tag=-1))  # first-call allocations out of the way
    base, peak, done = rss_mb(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    await asyncio.gather(*(service.from_bytes(d) for d in images))
    done.set()
    sampler.join()
    await asyncio.sleep(0.05)
    after = rss_mb()
    await service.stop()
    print(json.dumps({"base": base, "peak": max(peak[0], after), "after": after}))

asyncio.run(main())
"""


def burst_rss(budget: int, reduced: bool, n: int = 8, side: int = 3000) -> dict[str, float]:
    """RSS in MB of a child process before, at the peak of, and after n concurrent registrations of side^2 PNGs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(budget), "1" if reduced else "0", str(n), str(side)],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_burst_of_large_images_stays_within_a_memory_bound():
    # 8 concurrent 3000 x 3000 PNGs (9 Mpx, 36 MB each as Pillow RGB). Unbounded full-size decoding held them all at
    # once, with their RGB copies and the detector's float32 inputs: about 700 MB over the base (2-core test box).
    got = burst_rss(budget=10_000_000, reduced=True)
    assert got["peak"] - got["base"] < 250, got
    assert got["after"] - got["base"] < 80, got


def test_a_detector_with_a_plain_bilinear_resize_always_decodes_at_full_size():
    """The bottom-up-attention family samples the full image (no antialiasing): a reduced decode would change its
    input, so its regions would no longer equal its reference's; the pixel budget still bounds memory."""
    from models.detector import DetectorConfig

    assert decode_side(DetectorConfig(classes=["a"], resize="detectron2")) is None
    assert decode_side(DetectorConfig(classes=["a"])) == 2 * DetectorConfig(classes=["a"]).max_size
