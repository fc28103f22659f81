"""Service fixtures: a real redis-server on a free loopback port, and a tiny real detector saved to disk."""
from __future__ import annotations

import io
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import redis
import torch
from PIL import Image

from models.detector import DetectorConfig, RegionDetector
from models.detector.io import save_detector
from models.region_features import RegionFeatures


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(proc: subprocess.Popen, base: str, output, timeout_s: float = 90) -> None:
    """Poll `base`/readyz until 200; fails with the server's output() if it exits or is not ready in time."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, output()
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the service did not become ready"
        time.sleep(0.2)


@contextmanager
def served(log_dir: Path, checkpoint: Path, detector: TinyDetector, *options: str,
           env: dict[str, str] | None = None) -> Iterator[str]:
    """A real `vlserve serve` (uvicorn) of the checkpoint in a subprocess, with VLSERVE_ variables cleared (then
    `env` added): its base URL once ready; killed after, and its log must hold no traceback."""
    import os
    import sys

    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLSERVE_")}, **(env or {})}
    cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--model-dir", str(checkpoint), "--detector-dir",
           str(detector.dir), "--port", str(port), "--threads", "1", *options]
    log_path = log_dir / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_ready(proc, url, log_path.read_text)
            yield url
        finally:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]


class RedisServer:
    """A redis-server child process (no persistence, allkeys-lru as in production) that tests may stop and restart."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A synchronous client for test set-up and inspection."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def start(self) -> None:
        if self.proc is not None:
            return
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(self.workdir)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return
            except redis.exceptions.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing answers, as with a hung Redis."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    @property
    def running(self) -> bool:
        return self.proc is not None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """One redis-server for the session: `.url`, `.client()`, `.stop()`, `.start()` (same port)."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; `make install` provides it")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The URL of an empty, running Redis."""
    redis_server.start()
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url


@pytest.fixture
def restartable_redis(redis_server: RedisServer, redis_url: str) -> Iterator[RedisServer]:
    """The server, for tests that stop, restart, pause or resume it; it is running again afterwards whatever the test did."""
    yield redis_server
    if redis_server.running:
        redis_server.resume()  # harmless when it was not paused
    redis_server.start()


class TinyDetector(NamedTuple):
    dir: Path
    detector: RegionDetector
    fingerprint: str


TINY_DETECTOR = dict(min_size=64, max_size=128, rpn_pre_nms_top_n=100, rpn_post_nms_top_n=30, num_boxes=8,
                     feature_dim=16, classes=["circle", "rectangle", "triangle"], attributes=["red", "blue"])


def build_tiny_detector(out_dir: Path, seed: int = 0, **overrides) -> TinyDetector:
    """A real detector at test size (random weights, seeded), saved as a detector directory."""
    torch.manual_seed(seed)
    detector = RegionDetector(DetectorConfig(**{**TINY_DETECTOR, **overrides}), pretrained_backbone=False).eval()
    fingerprint = save_detector(detector, out_dir)
    return TinyDetector(out_dir, detector, fingerprint)


@pytest.fixture(scope="session")
def tiny_detector(tmp_path_factory) -> TinyDetector:
    """(dir, detector, fingerprint) of the tiny detector; feature_dim 16 matches the "tiny" encoder size."""
    return build_tiny_detector(tmp_path_factory.mktemp("detector"))


def shapes_image(h: int = 96, w: int = 128, seed: int = 0) -> np.ndarray:
    """A pale (h, w, 3) uint8 image with a red and a blue rectangle."""
    rng = np.random.default_rng(seed)
    img = np.full((h, w, 3), 240, np.uint8)
    for colour in ((200, 30, 30), (30, 30, 200)):
        bh, bw = int(rng.integers(h // 6, h // 2)), int(rng.integers(w // 6, w // 2))
        y, x = int(rng.integers(0, h - bh)), int(rng.integers(0, w - bw))
        img[y : y + bh, x : x + bw] = colour
    return img


def random_regions(seed: int, n_real: int, n: int = 8, d: int = 16) -> RegionFeatures:
    """n_real random regions padded to n rows, at rest precision (as the feature store returns them)."""
    rng = np.random.default_rng(seed)
    lo = rng.uniform(0, 60, (n_real, 2))
    rf = RegionFeatures(boxes=np.concatenate([lo, lo + rng.uniform(5, 60, (n_real, 2))], 1),
                        features=rng.standard_normal((n_real, d)), obj_ids=rng.integers(0, 3, n_real),
                        obj_scores=rng.uniform(size=n_real), attr_ids=rng.integers(0, 2, n_real),
                        attr_scores=rng.uniform(size=n_real), image_hw=(128, 128), num_boxes=n_real,
                        image_feature=rng.standard_normal(d))
    return rf.pad_to(n).to_float16()


def png_bytes(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


# ---- the app: a tiny encoder checkpoint with every served head, settings, problem+json checks ----------

VQA_ANSWERS = ["red", "blue", "circle", "rectangle", "two"]
SERVED_HEADS = {"vqa": {"kind": "vqa", "num_labels": len(VQA_ANSWERS)}, "refer": {"kind": "refer"},
                "itm": {"kind": "itm"}, "nlvr2": {"kind": "nlvr2"}}


def build_tiny_checkpoint(out_dir: Path, fingerprint: str, preset: str = "visualbert", heads: dict | None = None,
                          seed: int = 0, labels_extra: dict | None = None,
                          feature_dim: int = TINY_DETECTOR["feature_dim"], **encoder) -> Path:
    """A tiny encoder (random weights, seeded) saved as a checkpoint that expects the detector `fingerprint` and its
    `feature_dim`-wide regions; labels_extra joins its labels.json (e.g. a query bank)."""
    from models import create_model
    from models.checkpoint import save_checkpoint
    from models.tokenizer import VLTokenizer

    heads = SERVED_HEADS if heads is None else heads
    torch.manual_seed(seed)
    model = create_model(preset, "tiny", visual_feat_dim=feature_dim, heads=heads, **encoder)
    labels = {**({"heads": {"vqa": VQA_ANSWERS}} if "vqa" in heads else {}), **(labels_extra or {})}
    return save_checkpoint(model, out_dir, tokenizer=VLTokenizer.pretrained_minilm(), labels=labels,
                           detector={"fingerprint": fingerprint})


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_detector: TinyDetector) -> Path:
    """visualbert tiny with vqa, refer, itm and nlvr2 heads, matched to `tiny_detector`."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"), tiny_detector.fingerprint)


@pytest.fixture(scope="session")
def make_settings(tiny_checkpoint: Path, tiny_detector: TinyDetector):
    """Settings(**overrides) for the tiny model: one thread, short batching waits."""
    from service.settings import load_settings

    def make(**overrides):
        base = dict(model_dir=tiny_checkpoint, detector_dir=tiny_detector.dir, threads=1, max_wait_ms=2.0,
                    detector_max_wait_ms=2.0, redis_url=None)
        return load_settings(**{**base, **overrides})

    return make


# Bounds on served scores that follow the arithmetic in use. float32 kernels agree across batch shapes to rounding;
# bfloat16 GEMMs keep 8 mantissa bits, and oneDNN's AMX and AVX512-BF16 kernels accumulate in a different order for
# different batch shapes (a score moved 1.5e-5 on an AMX CPU when the request shared its batch). A test whose point
# is exactness pins fp32; one that checks the default service (precision "auto") uses the bound of what it runs.
SCORE_TOL = {"fp32": 1e-5, "bf16": 2e-2}


def score_tol(client) -> float:
    """The score bound of the precision a started TestClient's service runs in."""
    return SCORE_TOL[client.app.state.services.model.precision]


def while_the_encoder_is_held(batcher, send, n: int = 4, during=None) -> tuple[list, object]:
    """Hold `batcher`'s batch function; call send() (one request, its response) from one thread until its batch runs
    held, from more until the queue is full, then from the rest of n threads (each refused 429); call during() (if
    given) while the queue is still full, then release: (every response, during()'s result). Step by step, so that a
    429 is never seen while the first request is still queued (the queue empties when it starts to run)."""
    import threading

    release, run = threading.Event(), batcher.fn
    # hold the encoder until released below (the timeout only keeps a broken test from hanging)
    batcher.fn = lambda items: (release.wait(60), run(items))[1]
    responses: list = []
    threads: list[threading.Thread] = []

    def sent(until, what: str) -> None:
        thread = threading.Thread(target=lambda: responses.append(send()))
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 30
        while not until():
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            time.sleep(0.005)

    sent(lambda: bool(batcher._running), "the first request's batch runs")
    while len(batcher._queue) < batcher.config.max_queue:
        queued = len(batcher._queue)
        sent(lambda: len(batcher._queue) > queued, "a request is queued")
    while len(threads) < n:
        answered = len(responses)
        sent(lambda: len(responses) > answered, "a request is refused")
    extra = during() if during is not None else None
    release.set()
    for thread in threads:
        thread.join(30)
    batcher.fn = run
    return responses, extra


def assert_problem(response, status: int, kind: str | None = None) -> dict:
    """An RFC 9457 problem+json answer with this status (and problem type), never a trace."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json"), response.headers
    body = response.json()
    assert {"type", "title", "status", "detail", "instance"} <= set(body), body
    assert body["status"] == status and body["detail"] and "Traceback" not in response.text
    if kind is not None:
        assert body["type"] == f"/problems/{kind}", body
    return body


@pytest.fixture
def problem():
    """assert_problem(response, status, kind=None) -> the problem body."""
    return assert_problem


@pytest.fixture(scope="session")
def image_png() -> bytes:
    """A small PNG the tiny detector finds regions in."""
    return png_bytes(shapes_image())


@pytest.fixture(scope="session")
def make_png():
    """make_png(seed=0, h=96, w=128) -> PNG bytes of a shapes image."""
    return lambda seed=0, h=96, w=128: png_bytes(shapes_image(h, w, seed))


@pytest.fixture(scope="session")
def make_checkpoint():
    """build_tiny_checkpoint(out_dir, fingerprint, preset=..., heads=...)."""
    return build_tiny_checkpoint


@pytest.fixture(scope="session")
def make_detector():
    """build_tiny_detector(out_dir, seed=...)."""
    return build_tiny_detector


def metric(client, name: str, **labels) -> float:
    """A sample's value from the app's /metrics (0 when absent)."""
    text = client.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and ",".join(sorted((m.group(1) or "").split(","))) == (want or ""):
            return float(m.group(2))
    return 0.0
