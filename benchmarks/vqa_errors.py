"""Where a checkpoint's shapes-world VQA answers go wrong: accuracy per question kind (colour, shape, size,
relation, count, exists, as the dataset generates them) and the most common (gold -> predicted) confusions. With
--dataset easy-vqa, the easy-VQA test questions by kind: colour, shape, yes/no, and negated yes/no ("is there not a
circle?", "is no rectangle present?").

`vlserve eval` reports VQA accuracy per answer type (yes/no, number, other), as the official VQA evaluation does;
this script splits further by the generator's question kind, which the answer type mixes (a relation question and an
exists question are both yes/no). Prints a markdown table.

    python benchmarks/vqa_errors.py [--model-dir CKPT] [--detector-dir DET] [--split val] [--scenes 500] [--top 12]
                                    [--dataset shapes|easy-vqa]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing

from models.checkpoint import load_checkpoint  # noqa: E402
from training.data.shapes_cache import load_split  # noqa: E402
from training.evaluate import head_for, predictions  # noqa: E402
from training.vl_data import prepare_eval_data  # noqa: E402
from training.zoo import zoo_dir  # noqa: E402


def easy_vqa_kind(question: str, answer: str) -> str:
    """An easy-VQA question's kind, from its words: colour, shape, yes/no or negated yes/no."""
    if answer in ("yes", "no"):
        return "yes/no, negated" if {"not", "no"} & set(question.lower().rstrip("?").split()) else "yes/no"
    return "colour" if "color" in question.lower() else "shape"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=zoo_dir("demo") / "encoder")
    p.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--scenes", type=int, default=500)
    p.add_argument("--top", type=int, default=12, help="confusions listed")
    p.add_argument("--dataset", choices=("shapes", "easy-vqa"), default="shapes")
    args = p.parse_args()

    ckpt = load_checkpoint(args.model_dir)
    task = head_for(ckpt.model, "vqa")
    if task is None:
        sys.exit(f"error: {args.model_dir} has no vqa head")
    easy = args.dataset == "easy-vqa"
    scenes = 1 if easy else args.scenes  # easy-VQA: all 1,000 test images (their questions), no shapes-world scenes needed
    data = prepare_eval_data(args.detector_dir, args.split, scenes, easy_vqa_images=1_000 if easy else 0,
                             retrieval_pool=0, progress=False)
    examples = data.eval["easy_vqa" if easy else "vqa"]
    if easy:
        kinds = [easy_vqa_kind(e.text, data.answers[e.label]) for e in examples]
    else:  # shapes_examples lists each scene's questions in annotation order, scene after scene
        kinds = [q["type"] for ann in load_split(args.split).annotations[:args.scenes] for q in ann["vqa"]]
    assert len(kinds) == len(examples), (len(kinds), len(examples))
    names = ckpt.labels["heads"][task]
    predicted = [names[i] for i in predictions(ckpt.model, task, examples, data.eval_table, ckpt.tokenizer).argmax(-1).tolist()]
    gold = [data.answers[e.label] for e in examples]

    right, total, confusions = collections.Counter(), collections.Counter(), collections.Counter()
    for kind, g, pr in zip(kinds, gold, predicted):
        total[kind] += 1
        right[kind] += g == pr
        if g != pr:
            confusions[(kind, g, pr)] += 1
    where = "easy-VQA test" if easy else f"shapes-world {args.split}, {args.scenes} scenes"
    print(f"`{args.model_dir}` on {where}, {len(examples)} questions: "
          f"accuracy {sum(right.values()) / len(examples):.3f}\n")
    print("| question kind | questions | accuracy |\n|---|---|---|")
    for kind in sorted(total, key=lambda k: right[k] / total[k]):
        print(f"| {kind} | {total[kind]} | {right[kind] / total[kind]:.3f} |")
    print("\n| kind | gold | predicted | times |\n|---|---|---|---|")
    for (kind, g, pr), n in confusions.most_common(args.top):
        print(f"| {kind} | {g} | {pr} | {n} |")


if __name__ == "__main__":
    main()
