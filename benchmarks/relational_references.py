"""How a checkpoint answers about objects named plainly ("the red circle") and through a relation ("the shape left
of the red circle"): VQA accuracy per question kind and refer accuracy (IoU >= 0.5), each split by how the question or
expression names its object (docs/RESULTS.md, session 19).

A split's questions and expressions name an object through a relation only where no attribute-only description fits
it alone (`shapes_tasks.describe`), about 1 in 10 attribute questions and 1 in 20 expressions; `vlserve eval` mixes
them with the rest. Prints two markdown tables.

    python benchmarks/relational_references.py [--model-dir CKPT] [--detector-dir DET] [--split val] [--scenes 1000]
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing

from models.checkpoint import load_checkpoint  # noqa: E402
from training.data.shapes_cache import load_split  # noqa: E402
from training.data.shapes_world import RELATIONS  # noqa: E402
from training.evaluate import head_for, predicted_boxes, predictions  # noqa: E402
from training.metrics import box_iou  # noqa: E402
from training.vl_data import prepare_eval_data  # noqa: E402
from training.zoo import zoo_dir  # noqa: E402

THROUGH_RELATION = re.compile(" (" + "|".join(RELATIONS) + ") the ")


def naming(text: str) -> str:
    """'through a relation' when the text names an object relative to another, else 'plainly'."""
    return "through a relation" if THROUGH_RELATION.search(text) else "plainly"


def table(title: str, right: collections.Counter, total: collections.Counter) -> str:
    rows = "\n".join(f"| {kind} | {how} | {total[kind, how]} | {right[kind, how] / total[kind, how]:.3f} |"
                     for kind, how in sorted(total))
    return f"| {title} | object named | examples | accuracy |\n|---|---|---|---|\n{rows}\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=zoo_dir("demo") / "encoder")
    p.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--scenes", type=int, default=1000)
    args = p.parse_args()

    ckpt = load_checkpoint(args.model_dir)
    data = prepare_eval_data(args.detector_dir, args.split, args.scenes, easy_vqa_images=0, retrieval_pool=0, progress=False)
    annotations = load_split(args.split).annotations[:args.scenes]
    print(f"`{args.model_dir}` on shapes-world {args.split}, {args.scenes} scenes\n")

    right, total = collections.Counter(), collections.Counter()
    if (task := head_for(ckpt.model, "vqa")) is not None:
        examples = data.eval["vqa"]
        asked = [q for ann in annotations for q in ann["vqa"]]  # shapes_examples keeps annotation order
        assert [q["question"] for q in asked] == [e.text for e in examples]
        names = ckpt.labels["heads"][task]
        predicted = predictions(ckpt.model, task, examples, data.eval_table, ckpt.tokenizer).argmax(-1).tolist()
        for q, e, i in zip(asked, examples, predicted):
            # a relation question relates two plainly named objects; only attribute questions name one through another
            key = (q["type"], naming(q["question"]) if q["type"] != "relation" else "plainly")
            total[key] += 1
            right[key] += names[i] == data.answers[e.label]
        print(table("VQA question kind", right, total))

    right, total = collections.Counter(), collections.Counter()
    if (task := head_for(ckpt.model, "refer")) is not None:
        examples = data.eval["refer"]
        boxes = predicted_boxes(predictions(ckpt.model, task, examples, data.eval_table, ckpt.tokenizer), examples,
                                data.eval_table)
        gold = torch.tensor(np.array([e.label for e in examples], dtype=np.float32))
        hits = box_iou(boxes, gold) >= 0.5  # elementwise: each prediction against its own gold box
        for e, hit in zip(examples, hits.tolist()):
            key = ("refer", naming(e.text))
            total[key] += 1
            right[key] += hit
        print(table("task", right, total))


if __name__ == "__main__":
    main()
