"""Where the demo's lead phase leaves its plateau: the first lead steps of the demo profile's multi-task run (data
prepared once) for several AdamW kernels and seeds, the mean loss of every 25 steps. A lead still near its first
value at its end is what `FinetuneConfig.lead_retries` restarts (docs/RESULTS.md session 21). With --stage, the
retrieval stage's ranking lead instead, from the served multi-task checkpoint (--by-objects: one ranking group per
object of a scene, as `benchmarks/retrieval_stage.py --by-objects`).

    python benchmarks/lead_takeoff.py [--runs foreach:0,fused:0,foreach:1] [--steps 200]
    python benchmarks/lead_takeoff.py --stage [--by-objects] --runs foreach:0 --steps 300
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
import training.finetune as finetune  # noqa: E402
import training.vl_data  # noqa: E402
from training.data.vl_tasks import ranking_examples  # noqa: E402
from training.zoo import DEMO, MULTITASK, finetune_config, retrieval_config, zoo_dir  # noqa: E402

KERNELS = {"foreach": {"foreach": True}, "fused": {"fused": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    ap.add_argument("--runs", default="foreach:0,fused:0", help="KERNEL:SEED list (kernels: foreach, fused)")
    ap.add_argument("--steps", type=int, default=None, help="steps run (default: the lead's)")
    ap.add_argument("--stage", action="store_true", help="the retrieval stage's ranking lead")
    ap.add_argument("--by-objects", action="store_true", help="with --stage: one ranking group per object of a scene")
    args = ap.parse_args()
    if args.by_objects:
        training.vl_data.ranking_examples = lambda *a, **k: ranking_examples(*a, **k, by_objects=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dataclasses.replace(finetune_config(DEMO, args.detector_dir, Path(tmp) / "run"), lead_retries=0)
        if args.stage:
            cfg = retrieval_config(DEMO, dataclasses.replace(cfg, out=zoo_dir("demo") / MULTITASK), Path(tmp) / "run")
        data = finetune.run_data(cfg, False)
        args.steps = args.steps or cfg.lead_steps
        for run in args.runs.split(","):
            kernel, seed = run.split(":")
            finetune.adamw = lambda groups, lr, k=kernel: torch.optim.AdamW(groups, lr=lr, **KERNELS[k])
            out = Path(tmp) / run.replace(":", "-")
            losses = np.array(finetune.train(dataclasses.replace(cfg, out=out, seed=int(seed)), data=data, progress=False,
                                             stop_after=args.steps)["losses"])
            stalled, first, last = finetune.lead_stalled(dataclasses.replace(cfg, lead_steps=args.steps), list(losses))
            print(json.dumps({"stage": args.stage, "by_objects": args.by_objects, "kernel": kernel, "seed": int(seed), "stalled": stalled, "first": round(first, 3),
                              "last": round(last, 3),
                              "mean_per_25": [round(float(losses[i:i + 25].mean()), 3) for i in range(0, len(losses), 25)]}),
                  flush=True)


if __name__ == "__main__":
    main()
