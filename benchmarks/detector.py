"""Detector extraction speed on CPU: vlserve's RegionDetector vs torchvision's fasterrcnn_mobilenet_v3_large_fpn.

Same number of RPN proposals, same input resolution (no resizing: min_size = the image's shorter side), batch
1 and 8, 128x128 and 480x640 images; images/second, median of several timed runs after a warm-up, side by
side in one process. Writes its table into docs/BENCHMARKS.md.

    python benchmarks/detector.py [--runs 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn

from models.detector import DetectorConfig, RegionDetector

PRE_NMS, POST_NMS = 600, 150  # proposals per image for both detectors
SECTION = "## Detector: region extraction, vlserve vs torchvision fasterrcnn_mobilenet_v3_large_fpn"


def images_of(h: int, w: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        img = np.full((h, w, 3), 235, np.uint8)
        for _ in range(4):
            bh, bw = rng.integers(h // 8, h // 3), rng.integers(w // 8, w // 3)
            y, x = rng.integers(0, h - bh), rng.integers(0, w - bw)
            img[y : y + bh, x : x + bw] = rng.integers(0, 255, 3)
        out.append(img)
    return out


def ours(short_side: int, long_side: int, pretrained: bool = True) -> RegionDetector:
    cfg = DetectorConfig(classes=["circle", "rectangle", "triangle"], attributes=["red", "small"],
                         min_size=short_side, max_size=long_side, rpn_pre_nms_top_n=PRE_NMS, rpn_post_nms_top_n=POST_NMS)
    return RegionDetector(cfg, pretrained_backbone=pretrained).eval()


def reference(short_side: int, long_side: int):
    model = fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=4, min_size=short_side, max_size=long_side,
        rpn_pre_nms_top_n_test=PRE_NMS, rpn_post_nms_top_n_test=POST_NMS, box_detections_per_img=36,
    )
    return model.eval()


def time_it(fn, runs: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for h, w in [(128, 128), (480, 640)]:
        det, ref = ours(min(h, w), max(h, w)), reference(min(h, w), max(h, w))
        for batch in (1, 8):
            imgs = images_of(h, w, batch)
            tensors = [torch.from_numpy(im).permute(2, 0, 1).float() / 255 for im in imgs]
            with torch.inference_mode():
                t_ours = time_it(lambda: det.extract(imgs, batch_size=batch), args.runs)
                t_ref = time_it(lambda: ref(tensors), args.runs)
            rows.append((f"{h}x{w}", batch, batch / t_ours, batch / t_ref, t_ref / t_ours))
            print(rows[-1], flush=True)
    table = [
        "| image | batch | vlserve img/s | torchvision mobilenet_v3 FPN img/s | ratio (vlserve / torchvision) |",
        "|---|---|---|---|---|",
        *[f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f}x |" for r in rows],
    ]
    body = "\n".join([
        SECTION, "",
        f"Command: `python benchmarks/detector.py --runs {args.runs} --threads {args.threads}` "
        f"({datetime.date.today()}, {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}).",
        f"Both detectors: {PRE_NMS} pre-NMS / {POST_NMS} post-NMS proposals, no resizing, random weights (speed only);",
        "vlserve's time includes its full extraction (region selection, whole-image feature, RegionFeatures);",
        "torchvision's includes its standard post-processing. Median of the timed runs after one warm-up.", "",
        *table, "",
    ])
    print(body)
    if not args.no_write:
        write_section(Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md", SECTION, body)


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace (or append) the section that starts with `heading`, leaving the others alone."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + (body.rstrip("\n") + "\n\n" + text[end + 1 :] if end >= 0 else body)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


if __name__ == "__main__":
    main()
