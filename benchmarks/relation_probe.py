"""Can the demo's encoder learn shapes-world relation questions ("is the red circle left of the triangle?") at all?

Trains the demo profile's recipe on the relation questions of its 3,000 training scenes alone (the VQA task, no other
task, no easy-VQA) and scores the relation questions of its 500 val scenes every --eval-every steps. Two variants
separate the causes of the demo's 0.50 on them (docs/RESULTS.md, session 8):
- `--init-from CKPT` starts from a trained encoder (the served demo grounds referring expressions at 0.96), so the
  first hop of a relation, finding the two objects, is already learnt;
- `--head relation` replaces the VQA head with a Relation Network head (Santoro et al. 2017): an MLP over every
  pair of contextual regions with both boxes and the pooled question, averaged over the pairs, then a classifier.
  It is handed the pairwise geometry that the served head would have to assemble through attention.
- `--curriculum STEPS` first trains that many steps on one-object position questions made from the same scenes
  (training.data.shapes_tasks.position_questions, "is the red circle on the left?": the object's centre in the
  outer 40% of the image on that axis; one hop: find the object, read its box), scored on the val scenes' ones,
  then the relation steps start from that encoder.
- `--one-side STEPS` (with --curriculum) trains on "on the left?" and "at the top?" alone before that: there the
  answer follows the object's position, while with both sides of an axis it is the exclusive-or of position and
  question word, which a tiny encoder only learns after such a start (docs/RESULTS.md, session 9).
Needs the demo's detector (`make zoo`). Prints the accuracy at each evaluation.

    python benchmarks/relation_probe.py NAME [--steps 500] [--lr 2e-4] [--head vqa|relation] [--init-from CKPT]
                                             [--curriculum STEPS] [--one-side STEPS]
                                             [--box-embedding linear|normalized]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
from models.heads import VQAHead  # noqa: E402
from training import finetune, zoo  # noqa: E402
from training.data.shapes_tasks import ONE_SIDE  # noqa: E402
from training.vl_data import prepare_task_data  # noqa: E402

RELATION = re.compile(r"^is .+ (left of|right of|above|below) .+\?$")  # shapes_tasks.relation_questions' wording
ONE_SIDE_TEXT = tuple(f"{side}?" for side in ONE_SIDE)


class RelationNetworkHead(VQAHead):
    """Answer logits from g(region_i, box_i, region_j, box_j, question) averaged over the real pairs i != j."""

    def __init__(self, head, enc, hidden: int = 256):
        super().__init__(head, enc)
        pair = 2 * (enc.image_width + 4) + enc.pooled_size
        self.g = nn.Sequential(nn.Linear(pair, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.f = nn.Sequential(nn.Linear(hidden + enc.pooled_size, hidden), nn.ReLU(), nn.Linear(hidden, head.num_labels))

    def forward(self, enc, inputs):
        regions = torch.cat([enc.image, inputs.region_boxes.to(enc.image.dtype)], -1)  # (B, N, Hv + 4)
        b, n, _ = regions.shape
        pairs = torch.cat([regions[:, :, None].expand(b, n, n, -1), regions[:, None].expand(b, n, n, -1),
                           enc.pooled[:, None, None].expand(b, n, n, -1)], -1)  # (B, N, N, 2 (Hv + 4) + P)
        mask = inputs.region_mask.to(regions.dtype)
        real = mask[:, :, None] * mask[:, None, :] * (1 - torch.eye(n, dtype=regions.dtype))  # (B, N, N)
        g = (self.g(pairs) * real[..., None]).sum((1, 2)) / real.sum((1, 2)).clamp(min=1)[:, None]  # (B, hidden)
        return self.f(torch.cat([g, enc.pooled], -1))  # (B, A)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--lr", type=float, default=None, help="encoder peak lr (default: the demo's)")
    ap.add_argument("--head", choices=("vqa", "relation"), default="vqa")
    ap.add_argument("--init-from", type=Path, default=None)
    ap.add_argument("--curriculum", type=int, default=0, help="steps on one-object position questions first")
    ap.add_argument("--one-side", type=int, default=0,
                    help="steps on position questions of one side per axis ('on the left?', 'at the top?') before "
                         "--curriculum: each answer then follows the position alone, not its exclusive-or with the word")
    ap.add_argument("--box-init", choices=("model", "torch"), default="model",
                    help="torch: re-draw the box projection with nn.Linear's own init (column norm ~5.7, not ~0.4)")
    ap.add_argument("--box-embedding", choices=("linear", "normalized"), default=None,
                    help="u-visualbert's box embedding (default: the demo profile's)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--root", type=Path, default=Path("/tmp/vlserve-relation-probe"))
    args = ap.parse_args()

    profile = zoo.PROFILES["demo"]
    detector = zoo.zoo_dir("demo") / "detector"
    data = prepare_task_data(detector, profile.train_scenes, profile.eval_scenes, easy_vqa=False, progress=False,
                             question_sets=True)
    relations = {"train": [e for e in data.train["vqa"] if RELATION.match(e.text)],
                 "eval": [e for e in data.eval["vqa"] if RELATION.match(e.text)]}
    print(f"relation questions: {len(relations['train'])} train, {len(relations['eval'])} val", flush=True)
    build = finetune.build_model

    def build_model(cfg, feature_dim, num_answers):
        model = build(cfg, feature_dim, num_answers)
        if args.head == "relation":
            model.heads["vqa"] = RelationNetworkHead(model.config.heads["vqa"], model.config.encoder)
        if args.box_init == "torch" and cfg.init_from is None:
            model.encoder.embeddings.box_projection.reset_parameters()
        return model

    finetune.build_model = build_model
    cfg = zoo.finetune_config(profile, detector, args.root / args.name, threads=args.threads)
    cfg = dataclasses.replace(cfg, tasks={"vqa": 1.0}, steps=args.steps, eval_every=args.eval_every, eval_examples=None,
                              init_from=args.init_from, lr=args.lr or cfg.lr,
                              box_embedding=args.box_embedding or cfg.box_embedding)
    start = time.time()
    if args.curriculum:
        positions = {"train": data.train["positions"], "eval": data.eval["positions"]}
        print(f"position questions: {len(positions['train'])} train, {len(positions['eval'])} val", flush=True)
        first = dataclasses.replace(cfg, out=args.root / f"{args.name}-positions", steps=args.curriculum)
        if args.one_side:
            one_side = {"train": data.train["positions_one_side"],
                        "eval": [e for e in data.eval["positions"] if e.text.endswith(ONE_SIDE_TEXT)]}
            zero = dataclasses.replace(cfg, out=args.root / f"{args.name}-one-side", steps=args.one_side)
            report(args, "positions, one side per axis", zero, run(zero, data, one_side))
            first = dataclasses.replace(first, init_from=zero.out)
        report(args, "positions", first, run(first, data, positions))
        cfg = dataclasses.replace(cfg, init_from=first.out)
    report(args, "relations", cfg, run(cfg, data, relations))
    print(f"{time.time() - start:.0f} s")


def run(cfg, data, examples: dict) -> dict:
    data.train, data.eval = {"vqa": examples["train"]}, {"vqa": examples["eval"]}
    return finetune.train(cfg, data=data, progress=False)


def report(args, questions: str, cfg, metrics: dict) -> None:
    curve = {h["step"]: h["vqa_acc"] for h in metrics["history"]} | {cfg.steps: metrics["final"]["vqa_acc"]}
    print(args.name, json.dumps({"questions": questions, "head": args.head, "init_from": str(cfg.init_from), "lr": cfg.lr,
                                 "box_embedding": cfg.box_embedding,
                                 "accuracy": curve}), flush=True)


if __name__ == "__main__":
    main()
