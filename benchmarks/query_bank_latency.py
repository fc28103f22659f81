"""What a query bank costs /retrieve: text -> images over N registered shapes-world test images with the demo
model, in process (FastAPI TestClient, the service's batchers and torch runtime), side by side: raw scores
(`query_bank: false`); bank-normalised with every image's prior computed in the request (the first time the
images are ranked), with the bank's rows in caption order and shortest first (what the service does); bank-normalised
with the priors kept (every later request); and with the priors computed at registration (POST /images schedules
them in the background, `query_bank_on_register`): how long until they are all known, and the first /retrieve
after that. Each repeat starts fresh apps, so cold requests are cold; medians over the repeats. Run it on an
otherwise idle machine.

    python benchmarks/query_bank_latency.py [--model-dir CKPT] [--detector-dir DET] [--images 20] [--repeats 3]
"""
from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
from fastapi.testclient import TestClient  # noqa: E402

from service.app import create_app  # noqa: E402
from service.settings import load_settings  # noqa: E402
from training.data.shapes_cache import load_split  # noqa: E402
from training.zoo import zoo_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=zoo_dir("demo") / "encoder")
    ap.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    test = load_split("test")
    annotations = test.annotations[:args.images]
    images = [base64.b64encode(test.image_path(i).read_bytes()).decode() for i in range(len(annotations))]
    text = annotations[0]["captions"][0]
    times: dict[str, list[float]] = {name: [] for name in (
        "raw", "bank, priors computed, rows in caption order", "bank, priors computed, rows shortest first",
        "bank, priors kept", "registration of the images", "registration until every prior is known",
        "bank, first request after registration")}
    bank = 0

    def timed(name: str, call):
        started = time.perf_counter()
        out = call()
        times[name].append((time.perf_counter() - started) * 1000)
        return out

    def ranked(c, ids, **body) -> None:
        r = c.post("/retrieve", json={"text": text, "image_ids": ids, "top_k": 5, **body})
        assert r.status_code == 200, r.text

    def register(c) -> list[str]:
        return [c.post("/images", json={"image": image}).json()["image_id"] for image in images]

    for _ in range(args.repeats):
        settings = dict(model_dir=args.model_dir, detector_dir=args.detector_dir, threads=args.threads, redis_url=None)
        with TestClient(create_app(load_settings(**settings, query_bank_on_register=False))) as c:
            priors = c.app.state.services.pipeline.bank
            bank, shortest_first = len(priors.bank.texts), priors.rows
            ids = register(c)
            timed("raw", lambda: ranked(c, ids, query_bank=False))
            tokenizer = c.app.state.services.pipeline.tokenizer
            priors.rows = [{k: v[0] for k, v in tokenizer.encode([t]).items()} for t in priors.bank.texts]
            timed("bank, priors computed, rows in caption order", lambda: ranked(c, ids))
            priors._priors.clear()
            priors.rows = shortest_first
            timed("bank, priors computed, rows shortest first", lambda: ranked(c, ids))
            timed("bank, priors kept", lambda: ranked(c, ids))
        with TestClient(create_app(load_settings(**settings, query_bank_on_register=True))) as c:
            priors = c.app.state.services.pipeline.bank
            started = time.perf_counter()
            ids = timed("registration of the images", lambda: register(c))
            c.portal.call(priors.settle)
            times["registration until every prior is known"].append((time.perf_counter() - started) * 1000)
            assert priors.computed == len(ids)
            timed("bank, first request after registration", lambda: ranked(c, ids))
    result = {"images": args.images, "bank": bank, "repeats": args.repeats,
              "median_ms": {k: round(statistics.median(v), 1) for k, v in times.items()}}
    kept = result["median_ms"]["bank, priors kept"]
    result["priors_ms_per_image"] = {order: round((result["median_ms"][f"bank, priors computed, rows {order}"] - kept)
                                                  / args.images, 1) for order in ("in caption order", "shortest first")}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
