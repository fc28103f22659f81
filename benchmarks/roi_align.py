"""Region-detector training step on CPU with torchvision's RoIAlign against models.detector.roi_align.

One step = RegionDetector.losses (forward) + backward, batch 8 shapes-world scenes (128 x 128), the training
recipe's detector config; no optimizer step, so every step sees the same weights. Contenders, taking turns on one
detector (only its box_roi_pool changes), the same sampling seed every step:
  - torchvision: torchvision.ops.MultiScaleRoIAlign (its CPU roi_align backward is a single-threaded scalar loop)
  - matrix products: models.detector.roi_align.TrainingRoIAlign (what the detector uses now)
  - grid_sample: the same pooler with bilinear samples from F.grid_sample then a 2 x 2 mean (the other
    vectorised formulation; here for comparison only)
Also times the RoIAlign alone (forward + backward over the three FPN levels) at the shapes of one step.
Prints a markdown table; writes nothing.

    python benchmarks/roi_align.py [--runs 5] [--threads 2] [--batch 8]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.ops import MultiScaleRoIAlign

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from encoder import cpu_name  # noqa: E402

import models.detector.roi_align as fast  # noqa: E402
from models.detector import DetectorConfig, RegionDetector  # noqa: E402
from training.data.shapes_world import SHAPES, WorldConfig, generate_scene, render_scene, scene_to_dict  # noqa: E402
from training.detector_train import ATTRIBUTES, scene_target  # noqa: E402


def grid_sample_roi_align(input, rois, output_size, spatial_scale=1.0, sampling_ratio=-1, aligned=False):
    """torchvision's roi_align (sampling_ratio > 0, boxes inside the image) as grid_sample at every sample point,
    align_corners=True + border padding = torchvision's clamping, then the mean of each bin's samples."""
    ph, pw = (output_size, output_size) if isinstance(output_size, int) else output_size
    s, (n, c, h, w) = sampling_ratio, input.shape
    rois = rois.detach().double()
    off = 0.5 if aligned else 0.0
    x1, y1, x2, y2 = (rois[:, i] * spatial_scale - off for i in range(1, 5))
    rw, rh = (x2 - x1, y2 - y1) if aligned else ((x2 - x1).clamp(min=1.0), (y2 - y1).clamp(min=1.0))

    def points(start, size, bins):  # (K, bins * s)
        step = (size / bins)[:, None, None]
        i = torch.arange(bins, dtype=start.dtype)[None, :, None]
        a = (torch.arange(s, dtype=start.dtype) + 0.5)[None, None, :]
        return (start[:, None, None] + i * step + a * step / s).reshape(len(start), bins * s)

    gy = points(y1, rh, ph) * (2.0 / max(h - 1, 1)) - 1
    gx = points(x1, rw, pw) * (2.0 / max(w - 1, 1)) - 1
    grid = torch.stack(torch.broadcast_tensors(gx[:, None, :], gy[:, :, None]), -1).to(input.dtype)
    batch = rois[:, 0].long()
    out = []
    for b in range(n):  # rows come sorted by image from MultiScaleRoIAlign
        g = grid[batch == b]
        if len(g):
            sampled = F.grid_sample(input[b : b + 1], g.reshape(1, -1, pw * s, 2), mode="bilinear",
                                    padding_mode="border", align_corners=True)  # (1, C, Kb*ph*s, pw*s)
            out.append(F.avg_pool2d(sampled, s).view(c, len(g), ph, pw).transpose(0, 1))
    return torch.cat(out) if out else input.new_zeros(0, c, ph, pw)


@contextlib.contextmanager
def pooling_with(op):
    """TrainingRoIAlign pooling with `op` instead of models.detector.roi_align.roi_align (benchmark only)."""
    saved = fast.roi_align
    fast.roi_align = op
    try:
        yield
    finally:
        fast.roi_align = saved


def batch_of(n: int) -> tuple[list[np.ndarray], list[dict]]:
    world = WorldConfig()
    scenes = [generate_scene(world, "train", i) for i in range(n)]
    return ([np.asarray(render_scene(s), dtype=np.uint8) for s in scenes],
            [scene_target(scene_to_dict(s)) for s in scenes])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="timed steps per contender (after 2 warm-up steps each)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    det = RegionDetector(DetectorConfig(classes=list(SHAPES), attributes=list(ATTRIBUTES))).train()
    images, targets = batch_of(args.batch)
    plain = MultiScaleRoIAlign(["0", "1", "2"], det.config.roi_size, sampling_ratio=2)
    ours = det.roi_heads.box_roi_pool
    contenders = {  # name -> (pooler, roi_align the pooler uses)
        "torchvision roi_align": (plain, fast.roi_align),
        "matrix products (models.detector.roi_align)": (ours, fast.roi_align),
        "grid_sample + 2x2 mean": (ours, grid_sample_roi_align),
    }
    captured = {}

    def capture(module, inputs, output):
        captured["inputs"] = inputs

    def step(pooler, op) -> tuple[float, float]:
        """(seconds of one forward + backward, seconds of the RoIAlign alone, forward + backward, at its shapes)"""
        det.roi_heads.box_roi_pool = pooler
        hook = pooler.register_forward_hook(capture)
        try:
            with pooling_with(op):
                torch.manual_seed(0)
                det.zero_grad(set_to_none=True)
                start = time.perf_counter()
                sum(det.losses(images, targets).values()).backward()
                total = time.perf_counter() - start
                x, boxes, sizes = captured["inputs"]
                x = {k: v.detach().requires_grad_() for k, v in x.items()}
                start = time.perf_counter()
                pooled = pooler(x, boxes, sizes)
                pooled.backward(torch.ones_like(pooled))
                alone = time.perf_counter() - start
        finally:
            hook.remove()
            det.roi_heads.box_roi_pool = ours
        return total, alone

    for pooler, op in contenders.values():  # warm-up
        for _ in range(2):
            step(pooler, op)
    times = {name: [] for name in contenders}
    for r in range(args.runs):
        names = list(contenders)
        for name in names[r % len(names):] + names[: r % len(names)]:  # a different contender first each run
            times[name].append(step(*contenders[name]))
    _, boxes, _ = captured["inputs"]
    levels = det.roi_heads.box_roi_pool.map_levels(boxes) if det.roi_heads.box_roi_pool.map_levels else None
    per_level = torch.bincount(levels, minlength=3).tolist() if levels is not None else "?"
    base = statistics.median(t for t, _ in times["torchvision roi_align"])
    rows = []
    for name, ts in times.items():
        step_s, alone_s = statistics.median(t for t, _ in ts), statistics.median(a for _, a in ts)
        rows.append(f"| {name} | {step_s * 1000:.0f} | **{base / step_s:.2f}x** | {alone_s * 1000:.1f} |")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print("\n".join([
        f"Command: `python benchmarks/roi_align.py --runs {args.runs} --threads {args.threads} --batch {args.batch}` "
        f"· {cpu_name()}, {args.threads} threads, load average after the runs {load} · torch {torch.__version__}.",
        "",
        f"One detector training step (losses forward + backward, no optimizer step), batch {args.batch} shapes-world "
        f"scenes 128 x 128, {sum(len(b) for b in boxes)} sampled RoIs (per FPN level: {per_level}); median of "
        f"{args.runs} steps per contender, taking turns. RoIAlign alone: the pooler's forward + backward at the "
        "same inputs.",
        "",
        "| RoIAlign | ms per step | speed-up | RoIAlign alone, ms |",
        "|---|---|---|---|",
        *rows,
    ]))


if __name__ == "__main__":
    main()
