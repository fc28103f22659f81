"""What a query bank costs /retrieve: text -> images over N registered shapes-world test images with the demo
model, in process (FastAPI TestClient, the service's batchers and torch runtime), three ways side by side: raw
scores (`query_bank: false`), bank-normalised with every image's prior computed in the request (the first time
the images are ranked), and bank-normalised with the priors kept (every later request). Each repeat starts a
fresh app, so the cold request is cold; medians over the repeats. Run it on an otherwise idle machine.

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
    times: dict[str, list[float]] = {"raw": [], "bank, priors computed": [], "bank, priors kept": []}
    bank = 0
    for _ in range(args.repeats):
        settings = load_settings(model_dir=args.model_dir, detector_dir=args.detector_dir, threads=args.threads,
                                 redis_url=None)
        with TestClient(create_app(settings)) as c:
            bank = len(c.app.state.services.pipeline.bank.bank.texts)
            ids = [c.post("/images", json={"image": image}).json()["image_id"] for image in images]
            for name, body in (("raw", {"query_bank": False}), ("bank, priors computed", {}), ("bank, priors kept", {})):
                started = time.perf_counter()
                r = c.post("/retrieve", json={"text": text, "image_ids": ids, "top_k": 5, **body})
                times[name].append((time.perf_counter() - started) * 1000)
                assert r.status_code == 200, r.text
    result = {"images": args.images, "bank": bank, "repeats": args.repeats,
              "median_ms": {k: round(statistics.median(v), 1) for k, v in times.items()}}
    result["priors_ms_per_image"] = round((result["median_ms"]["bank, priors computed"]
                                           - result["median_ms"]["bank, priors kept"]) / args.images, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
