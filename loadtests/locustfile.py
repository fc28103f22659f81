"""Load test of a running vlserve: a mix of every task on repeated images (locust, headless, bounded).

    locust -f loadtests/locustfile.py --config loadtests/locust.conf --host http://127.0.0.1:8000

loadtests/locust.conf makes it headless and bounded (32 users, 60 s); override with -u, -r, -t. Set
VLSERVE_API_KEY when the service needs an X-API-Key. Needs only locust: the test images are PNGs written here.
Each user registers a few images (POST /images) once, then mostly asks by image_id, sometimes sends the
image inline; 429 answers (queue full) are reported as failures named "429 ...".
"""
from __future__ import annotations

import base64
import os
import random
import struct
import zlib

from gevent.lock import Semaphore
from locust import HttpUser, between, events, task

IMAGES = 8  # distinct images shared by all users (repeated images: the feature store is warm after the first)
QUESTIONS = ["what color is the rectangle?", "how many shapes are there?", "is there a green shape?"]
CAPTIONS = ["a red rectangle and a green rectangle", "two blue circles", "an empty picture", "a green triangle"]


def png(width: int, height: int, seed: int) -> bytes:
    """A pale RGB PNG with two coloured rectangles, encoded with zlib alone."""
    rng = random.Random(seed)
    pixels = [[(235, 235, 235)] * width for _ in range(height)]
    for colour in ((200, 30, 30), (30, 160, 40)):
        w, h = rng.randint(width // 6, width // 2), rng.randint(height // 6, height // 2)
        x, y = rng.randint(0, width - w), rng.randint(0, height - h)
        for row in pixels[y : y + h]:
            row[x : x + w] = [colour] * w
    raw = b"".join(b"\0" + bytes(v for px in row for v in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


PICTURES = [base64.b64encode(png(320, 240, seed)).decode() for seed in range(IMAGES)]


class VLServeUser(HttpUser):
    wait_time = between(0.0, 0.2)
    image_ids: list[str] = []  # shared by every user once registered
    registering = Semaphore()  # the first user registers the images; the others wait for it

    def on_start(self) -> None:
        key = os.environ.get("VLSERVE_API_KEY")
        if key:
            self.client.headers["X-API-Key"] = key
        with VLServeUser.registering:
            if not VLServeUser.image_ids:
                self.register()

    def register(self) -> None:
        ids = []
        for picture in PICTURES:
            with self.client.post("/images", json={"image": picture}, name="/images (register)", catch_response=True) as r:
                if r.status_code != 200:
                    r.failure(f"{r.status_code} registering an image")
                    return
                ids.append(r.json()["image_id"])
        VLServeUser.image_ids = ids

    def post(self, path: str, body: dict, name: str | None = None) -> None:
        with self.client.post(path, json=body, name=name or path, catch_response=True) as r:
            if r.status_code == 429:
                r.failure(f"429 queue full (Retry-After {r.headers.get('Retry-After')})")
            elif r.status_code != 200:
                r.failure(f"{r.status_code} {r.text[:200]}")

    def some_id(self) -> dict:
        return {"image_id": random.choice(self.image_ids)} if self.image_ids else {"image": random.choice(PICTURES)}

    @task(6)
    def vqa_by_id(self) -> None:
        self.post("/vqa", {**self.some_id(), "question": random.choice(QUESTIONS), "top_k": 3})

    @task(2)
    def vqa_inline(self) -> None:
        self.post("/vqa", {"image": random.choice(PICTURES), "question": random.choice(QUESTIONS)}, "/vqa (inline)")

    @task(2)
    def refer(self) -> None:
        self.post("/refer", {**self.some_id(), "expression": "the red rectangle"})

    @task(1)
    def text_to_images(self) -> None:
        if self.image_ids:
            self.post("/retrieve", {"text": random.choice(CAPTIONS), "image_ids": self.image_ids, "top_k": 3},
                      "/retrieve (text -> images)")

    @task(1)
    def image_to_texts(self) -> None:
        self.post("/retrieve", {**self.some_id(), "texts": CAPTIONS, "top_k": 2}, "/retrieve (image -> texts)")

    @task(1)
    def nlvr2(self) -> None:
        self.post("/nlvr2", {"images": [self.some_id(), self.some_id()], "statement": "both images show a red rectangle"})


@events.quitting.add_listener
def _fail_on_errors(environment, **_kwargs) -> None:
    """Exit code 1 when more than 1% of the requests failed (CI-friendly)."""
    stats = environment.stats.total
    if stats.num_requests and stats.fail_ratio > 0.01:
        environment.process_exit_code = 1
