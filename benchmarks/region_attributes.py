"""What a detector's region features say about each object: a linear probe of colour, size and shape.

Each shapes-world object is matched to the extracted region that overlaps it most (IoU >= 0.5); a softmax
regression per attribute is fitted on the regions of the training scenes and scored on those of the val scenes. A
listing caption of n objects is verifiable only where all n objects read right, so the probe's whole-object accuracy
to the n-th power bounds text -> image retrieval of such listings (docs/RESULTS.md, "Detector").

    python benchmarks/region_attributes.py --detector-dir ~/.cache/vlserve/zoo/demo/detector [--train 3000 --val 500]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torchvision.ops import box_iou

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
from training.data.shapes_cache import ShapesConfig, load_split  # noqa: E402
from training.vl_data import prepare_task_data  # noqa: E402
from training.zoo import zoo_dir  # noqa: E402

ATTRIBUTES = ("color", "size", "shape")


def matched_regions(table, annotations) -> tuple[np.ndarray, list[tuple[str, str, str]], int]:
    """(features of the region matched to each object, its (color, size, shape), objects without a region)."""
    features, labels, unmatched = [], [], 0
    for i, ann in enumerate(annotations):
        gold = torch.tensor([o["box"] for o in ann["objects"]], dtype=torch.float32).reshape(-1, 4)
        k = int(table.mask[i].sum())
        iou = box_iou(gold, torch.from_numpy(table.pixel_boxes[i, :k])) if k else torch.zeros(len(gold), 0)
        for o, obj in enumerate(ann["objects"]):
            j = int(iou[o].argmax()) if k else -1
            if k and iou[o, j] >= 0.5:
                features.append(table.features[i, j].astype(np.float32))
                labels.append(tuple(obj[a] for a in ATTRIBUTES))
            else:
                unmatched += 1
    return np.stack(features), labels, unmatched


def fit_probe(x: torch.Tensor, names: list[str], steps: int = 400) -> tuple[torch.nn.Linear, list[str]]:
    """Softmax regression (Adam, full batch, small weight decay) of standardised features onto the names."""
    classes = sorted(set(names))
    target = torch.tensor([classes.index(n) for n in names])
    torch.manual_seed(0)
    probe = torch.nn.Linear(x.shape[1], len(classes))
    opt = torch.optim.Adam(probe.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(probe(x), target).backward()
        opt.step()
    return probe, classes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    ap.add_argument("--train", type=int, default=3000, help="training scenes the probe is fitted on")
    ap.add_argument("--val", type=int, default=500, help="val scenes it is scored on")
    args = ap.parse_args()
    torch.set_num_threads(2)
    data = prepare_task_data(args.detector_dir, args.train, args.val, easy_vqa=False, progress=False)
    train_x, train_y, _ = matched_regions(data.train_table, load_split("train", ShapesConfig()).annotations[:args.train])
    val_x, val_y, unmatched = matched_regions(data.eval_table, load_split("val", ShapesConfig()).annotations[:args.val])
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    norm = lambda x: torch.from_numpy((x - mean) / std)  # noqa: E731
    right, confused = {}, Counter()
    for a, name in enumerate(ATTRIBUTES):
        probe, classes = fit_probe(norm(train_x), [y[a] for y in train_y])
        with torch.no_grad():
            guess = [classes[c] for c in probe(norm(val_x)).argmax(1).tolist()]
        right[name] = np.array([g == y[a] for g, y in zip(guess, val_y)])
        if name == "color":
            confused = Counter(f"{y[a]} read as {g}" for g, y in zip(guess, val_y) if g != y[a])
    whole = right["color"] & right["size"] & right["shape"]
    objects = len(val_y) + unmatched
    read = whole.sum() / objects  # an object without a region is not read either
    result = {"detector": str(args.detector_dir), "fingerprint": data.fingerprint, "val_objects": objects,
              "without_region": unmatched, **{f"{n}_acc": round(float(r.mean()), 4) for n, r in right.items()},
              "object_read_right": round(float(read), 4), "six_objects_read_right": round(float(read ** 6), 4),
              "color_confusions": dict(confused.most_common(5))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
