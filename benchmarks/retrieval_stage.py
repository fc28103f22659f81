"""A retrieval stage from a fine-tuned encoder: train the given task mix from it, then text -> image R@K of listing
captions over the val pool, with the kinds of top-1 misses (the experiments of docs/RESULTS.md, session 14).

    python benchmarks/retrieval_stage.py --out /tmp/rank1200 --steps 1200 --tasks itm_rank:1,itm_rank_text:1
    python benchmarks/retrieval_stage.py --out /tmp/stage --steps 1500 \
        --tasks vqa:1,refer:1,itm:1,nlvr2:1,positions:0.5,itm_rank:6,itm_rank_text:6
    python benchmarks/retrieval_stage.py --out /tmp/base --steps 0   # the starting encoder alone
    python benchmarks/retrieval_stage.py --out /tmp/rank --steps 1500 --rank-pool pooled --tasks ...  # a ranking head of its own
    python benchmarks/retrieval_stage.py ... --query-bank 256  # also ranked with a query bank (models.query_bank)

The run is the demo profile's fine-tuning config (data, bf16, lr, frozen word table) started from --init-from with
a 50-step warm-up, no lead phase or curriculum; --hard/--neighbours set the image groups (itm_rank) of
`training.data.vl_tasks.ranking_examples`. Each run prints one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
import training.vl_data  # noqa: E402
from models.checkpoint import load_checkpoint  # noqa: E402
from training.data.vl_tasks import RANK_GROUP, RANK_HARD, RANK_NEIGHBOURS, ranking_examples  # noqa: E402
from training.finetune import gemm_precision, train  # noqa: E402
from models.query_bank import normalised  # noqa: E402
from training.retrieval import (  # noqa: E402
    itm_scorer, pool_priors, query_sample, retrieval_head, retrieval_recall, score_grid, training_bank,
)
from training.vl_data import prepare_task_data, tagged  # noqa: E402
from training.zoo import DEMO, MULTITASK, finetune_config, zoo_dir  # noqa: E402


def miss_kind(query: tuple, top: tuple) -> str:
    """How the top-ranked scene's objects differ from those of the query caption's scene."""
    want, got = Counter(query), Counter(top)
    missing, extra = want - got, got - want
    m, e = sum(missing.values()), sum(extra.values())
    if m == 1 and e == 1:
        (a,), (b,) = missing, extra
        return "one object's " + "+".join(f for f, x, y in zip(("size", "color", "shape"), a, b) if x != y)
    if (m, e) == (1, 0):
        return "one object fewer"
    if (m, e) == (0, 1):
        return "one object more"
    if e == 0:
        return "a part of the listing (two or more objects fewer)"
    return "two or more objects differ"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="checkpoint directory of the stage")
    ap.add_argument("--init-from", type=Path, default=zoo_dir("demo") / MULTITASK, help="the encoder the stage starts from")
    ap.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    ap.add_argument("--steps", type=int, default=1200, help="stage steps (0: evaluate --init-from alone)")
    ap.add_argument("--tasks", default="itm_rank:1,itm_rank_text:1", help="task:weight list of the stage")
    ap.add_argument("--hard", type=int, default=RANK_HARD, help="itm_rank: negatives drawn from the closest scenes")
    ap.add_argument("--neighbours", type=int, default=RANK_NEIGHBOURS, help="itm_rank: how many closest scenes they come from")
    ap.add_argument("--group", type=int, default=RANK_GROUP, help="itm_rank: images per group (the caption's own first)")
    ap.add_argument("--by-objects", action="store_true", help="itm_rank: a scene of n objects gives n groups")
    ap.add_argument("--partial", type=int, default=0, help="itm_rank: negatives drawn from the scenes made of a part of "
                                                            "the listing's objects")
    ap.add_argument("--queries", type=int, default=100, help="listing captions, each ranks the whole val pool")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=DEMO.num_layers, help="encoder layers (that of --init-from)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lead-tasks", default="", help="comma-separated tasks the stage trains alone first")
    ap.add_argument("--lead-steps", type=int, default=0, help="steps of --lead-tasks alone")
    ap.add_argument("--query-bank", type=int, default=0, help="also rank with a query bank of this many training listing "
                                                                  "captions (models.query_bank; 0: raw scores only)")
    ap.add_argument("--query-bank-temperature", type=float, default=1.0)
    ap.add_argument("--rank-pool", choices=("pooled", "regions"), default=None,
                    help="the ranking sets train a ranking head of their own reading this pool (default: the itm head)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tasks = {name: float(w) for name, w in (item.split(":") for item in args.tasks.split(","))}
    cfg = dataclasses.replace(finetune_config(DEMO, args.detector_dir, args.out), init_from=args.init_from, tasks=tasks,
                              steps=max(1, args.steps), lead_tasks=tuple(t for t in args.lead_tasks.split(",") if t),
                              lead_steps=args.lead_steps, curriculum=(), warmup=50,
                              eval_every=10**9, retrieval_queries=0, seed=args.seed, threads=args.threads,
                              rank_pool=args.rank_pool, num_layers=args.num_layers)
    training.vl_data.ranking_examples = functools.partial(ranking_examples, hard=args.hard, neighbours=args.neighbours,
                                                          group_size=args.group, by_objects=args.by_objects,
                                                          partial=args.partial)
    data = prepare_task_data(cfg.detector_dir, cfg.train_scenes, cfg.eval_scenes, cfg.easy_vqa, False,
                             easy_vqa_images=cfg.easy_vqa_images, ranking=True, question_sets=True)
    result: dict = {"init_from": str(args.init_from), "steps": args.steps, "tasks": tasks, "rank_pool": args.rank_pool, "hard": args.hard,
                    "group": args.group, "by_objects": args.by_objects, "partial": args.partial,
                    "neighbours": args.neighbours, "seed": args.seed,
                    **({"lead": [cfg.lead_tasks, cfg.lead_steps]} if cfg.lead_steps else {})}
    if args.steps:
        metrics = train(cfg, data=data, progress=False)
        result.update(final=metrics["final"], train_seconds=metrics["train_seconds"])
        ckpt = load_checkpoint(args.out)
    else:
        ckpt = load_checkpoint(args.init_from)
    model, tokenizer = ckpt.model, ckpt.tokenizer
    data = tagged(data, model, tokenizer)
    examples = data.eval["retrieval"]
    keys = [e.label for e in examples]
    q = query_sample(len(examples), args.queries, 0)
    started = time.perf_counter()
    with gemm_precision(model, "bf16"):
        grid = score_grid(itm_scorer(model, retrieval_head(model), examples, data.eval_table, tokenizer), q, np.arange(len(examples)))
    # the project's metrics over that grid (retrieval_recall scores the same queries against every pool image)
    priors, temperature = None, args.query_bank_temperature
    if args.query_bank:  # as a stage with --query-bank keeps it: listing captions of the training groups
        bank = training_bank(data.train["itm_rank"], args.query_bank, temperature)
        with gemm_precision(model, "bf16"):
            priors = pool_priors(model, retrieval_head(model), bank, [e.rows[0] for e in examples], data.eval_table, tokenizer)
        result["query_bank"] = {"captions": args.query_bank, "temperature": temperature}
    found = retrieval_recall(lambda t, i: grid[np.searchsorted(q, t), i], len(examples), args.queries, keys=keys,
                             directions=("text_to_image",), priors=priors, temperature=temperature)
    ranked = grid if priors is None else torch.from_numpy(normalised(grid.numpy(), priors.numpy(), temperature))
    fits = Counter(keys)
    misses = Counter(miss_kind(keys[i], keys[t]) for i, t in zip(q, ranked.argmax(1).tolist()) if keys[i] != keys[t])
    result.update(found, gold_r1_ceiling=round(float(np.mean([1 / fits[keys[i]] for i in q])), 4),
                  top1_misses=dict(misses.most_common()), retrieval_seconds=round(time.perf_counter() - started, 1))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
