"""One encoder run of a zoo profile's recipe with some fields changed, for recipe experiments (docs/RESULTS.md).

Prints the periodic evaluations as they happen, then per 100 steps the mean loss and the gradient norm before
clipping (median, max, steps clipped; median per parameter family: heads, the encoder's new visual parts, the rest),
then the final metrics. Needs the profile's detector (`make zoo`). The run directory is replaced.

    python benchmarks/recipe_run.py NAME '{"seed": 1, "itm_pool": "regions", "lead_tasks": ["refer"], "lead_steps": 200}'
        [--profile demo] [--threads 2] [--stop 601] [--detector DIR]

Keys may be fields of training.zoo.Profile or of training.finetune.FinetuneConfig (eval_every, eval_examples, clip, ...).
--stop ends the run after that many steps (no final evaluation): early dynamics at the full run's lr schedule.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
from training import finetune, zoo  # noqa: E402

VISUAL = ("visual_projection", "box_projection", "visual_token_type", "visual_position")  # an encoder's new visual parts


def family(name: str) -> str:
    return "heads" if name.startswith("heads.") else "visual" if any(v in name for v in VISUAL) else "encoder"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("overrides", nargs="?", default="{}")
    ap.add_argument("--profile", default="demo", choices=list(zoo.PROFILES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stop", type=int, default=None)
    ap.add_argument("--root", type=Path, default=Path("/tmp/vlserve-recipe-runs"))
    ap.add_argument("--detector", type=Path, default=None, help="a detector directory other than the profile's")
    args = ap.parse_args()
    over = json.loads(args.overrides)
    profile_fields = {f.name for f in dataclasses.fields(zoo.Profile)}
    config_fields = {f.name for f in dataclasses.fields(finetune.FinetuneConfig)}
    unknown = set(over) - profile_fields - config_fields
    if unknown:
        ap.error(f"unknown field(s) {', '.join(sorted(unknown))}")
    tuples = {k: tuple(v) if isinstance(v, list) else v for k, v in over.items()}
    p = dataclasses.replace(zoo.PROFILES[args.profile], **{k: v for k, v in tuples.items() if k in profile_fields})
    if p.pretrain_steps and "init_from" not in over:
        ap.error(f"profile {args.profile!r} fine-tunes from its pretraining stage: pass its checkpoint as init_from")
    out = args.root / args.name
    cfg = zoo.finetune_config(p, args.detector or zoo.zoo_dir(args.profile) / "detector", out, threads=args.threads)
    # a config field wins over what the profile made of it (retrieval_queries, which finetune_config zeroes for a
    # profile with a retrieval stage; eval_every, which it derives)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in tuples.items() if k in config_fields})
    shutil.rmtree(out, ignore_errors=True)
    print("config", cfg, flush=True)

    norms: list[dict[str, float]] = []  # per step: total and per family, before clipping
    families: dict[int, str] = {}
    clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(params, max_norm, *a, **k):
        params = [q for q in params if q.grad is not None]
        sums: dict[str, float] = {}
        for q in params:
            fam = families.get(id(q), "encoder")
            sums[fam] = sums.get(fam, 0.0) + float(q.grad.float().pow(2).sum())
        total = clip(params, max_norm, *a, **k)
        norms.append({"total": float(total), **{f: v ** 0.5 for f, v in sums.items()}})
        return total

    groups = finetune.param_groups

    def naming_groups(model, c):
        families.update({id(q): family(n) for n, q in model.named_parameters()})
        return groups(model, c)

    finetune.param_groups, finetune.torch.nn.utils.clip_grad_norm_ = naming_groups, recording_clip
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    logging.getLogger("training.finetune").setLevel(logging.INFO)
    start = time.time()
    metrics = finetune.train(cfg, progress=False, stop_after=args.stop)
    losses = metrics["losses"]
    for s in range(0, len(losses), 100):
        window = norms[s:s + 100]
        fams = sorted({f for n in window for f in n} - {"total"})
        per_family = " ".join(f"{f} {statistics.median(n.get(f, 0.0) for n in window):.2f}" for f in fams)
        totals = [n["total"] for n in window]
        print(f"steps {s}-{s + len(window) - 1}: loss {statistics.mean(losses[s:s + 100]):.3f} grad norm median "
              f"{statistics.median(totals):.2f} max {max(totals):.2f} clipped {sum(t > cfg.clip for t in totals)}; {per_family}")
    print("final", args.name, json.dumps(metrics.get("final", {})), f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
