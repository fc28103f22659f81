"""How well a detector's chosen regions stand for a scene's objects, for fixed top-N and for confidence thresholds.

For each selection rule, over shapes-world val scenes: objects covered by a region (IoU >= 0.5), regions that
duplicate an object an earlier (more confident) region already covers, regions that cover no object, the mean
number of regions, and the share of scenes whose region count equals their object count (what a counting question
needs). The detector runs once per scene with a wide top-N; every rule is a prefix of its confidence order,
chosen by the detector's own `models.detector.select.choose_regions`.

    python benchmarks/region_selection.py --detector ~/.cache/vlserve/zoo/demo/detector [--scenes 500]
        [--fixed 8] [--thresholds 0.2,0.3,0.5,0.7] [--max-boxes 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
from models.detector.io import load_detector  # noqa: E402
from models.detector.select import choose_regions  # noqa: E402
from training.data.shapes_cache import load_split  # noqa: E402
from training.data.shapes_world import box_iou  # noqa: E402


def tally(regions: list[tuple[np.ndarray, np.ndarray]], objects: list[list[tuple]], rule) -> dict[str, float]:
    """Counts over scenes for one rule: rule(conf) -> how many of the confidence-ordered regions to keep."""
    covered = dups = false = kept_total = exact = total = 0
    for (boxes, conf), objs in zip(regions, objects):
        k = rule(conf)
        kept_total += k
        exact += k == len(objs)
        total += len(objs)
        seen: set[int] = set()
        for box in boxes[:k]:
            hits = [j for j, o in enumerate(objs) if box_iou(tuple(box), o) >= 0.5]
            if not hits:
                false += 1
            elif all(j in seen for j in hits):
                dups += 1
            seen.update(hits)
        covered += len(seen)
    n = len(regions)
    return {"objects": total, "missed": total - covered, "duplicates": dups, "false": false,
            "regions_per_scene": kept_total / n, "count_exact": exact / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--detector", type=Path, required=True)
    ap.add_argument("--scenes", type=int, default=500)
    ap.add_argument("--fixed", type=int, default=8, help="N of the fixed top-N rule")
    ap.add_argument("--thresholds", default="0.2,0.3,0.5,0.7")
    ap.add_argument("--min-boxes", type=int, default=1)
    ap.add_argument("--max-boxes", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    detector, fingerprint = load_detector(args.detector)
    wide = max(args.fixed, args.max_boxes)
    detector.config = dataclasses.replace(detector.config, num_boxes=wide, adaptive=False)
    split = load_split("val")
    n = min(args.scenes, len(split))
    objects = [[o.box for o in split.scene(i).objects] for i in range(n)]
    regions = []
    for start in range(0, n, 32):
        images = [np.asarray(split.image(i)) for i in range(start, min(n, start + 32))]
        for r in detector.extract(images):
            regions.append((r.boxes[: r.num_boxes], r.obj_scores[: r.num_boxes]))
    print(f"detector {fingerprint}, {n} val scenes, {sum(map(len, objects))} objects")
    print("| rule | regions per scene | objects missed | duplicate regions | regions on no object | count exact |")
    print("|---|---|---|---|---|---|")
    def rule(adaptive: bool, thresh: float = 0.0):
        """How many of a scene's confidence-ordered regions the detector's own selection keeps."""
        return lambda conf: len(choose_regions(torch.from_numpy(conf), args.fixed, adaptive, args.min_boxes,
                                               args.max_boxes, thresh))

    rules = {f"top {args.fixed}": rule(False)}
    for t in (float(x) for x in args.thresholds.split(",")):
        rules[f"conf >= {t:g}, {args.min_boxes}-{args.max_boxes}"] = rule(True, t)
    for name, rule in rules.items():
        s = tally(regions, objects, rule)
        print(f"| {name} | {s['regions_per_scene']:.2f} | {s['missed']} | {s['duplicates']} | {s['false']} | "
              f"{s['count_exact']:.3f} |")


if __name__ == "__main__":
    main()
