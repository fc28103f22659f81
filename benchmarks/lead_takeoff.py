"""Where the demo's lead phase leaves its plateau: the first lead steps of the demo profile's multi-task run (data
prepared once) for several AdamW kernels and seeds, the mean loss of every 25 steps. A lead still near its first
value at its end is what `FinetuneConfig.lead_retries` restarts (docs/RESULTS.md session 21).

    python benchmarks/lead_takeoff.py [--runs foreach:0,fused:0,foreach:1] [--steps 200]
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
from training.zoo import DEMO, finetune_config, zoo_dir  # noqa: E402

KERNELS = {"foreach": {"foreach": True}, "fused": {"fused": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    ap.add_argument("--runs", default="foreach:0,fused:0", help="KERNEL:SEED list (kernels: foreach, fused)")
    ap.add_argument("--steps", type=int, default=DEMO.lead_steps)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dataclasses.replace(finetune_config(DEMO, args.detector_dir, Path(tmp) / "run"), lead_retries=0)
        data = finetune.run_data(cfg, False)
        for run in args.runs.split(","):
            kernel, seed = run.split(":")
            finetune.adamw = lambda groups, lr, k=kernel: torch.optim.AdamW(groups, lr=lr, **KERNELS[k])
            out = Path(tmp) / run.replace(":", "-")
            losses = np.array(finetune.train(dataclasses.replace(cfg, out=out, seed=int(seed)), data=data, progress=False,
                                             stop_after=args.steps)["losses"])
            stalled, first, last = finetune.lead_stalled(dataclasses.replace(cfg, lead_steps=args.steps), list(losses))
            print(json.dumps({"kernel": kernel, "seed": int(seed), "stalled": stalled, "first": round(first, 3),
                              "last": round(last, 3),
                              "mean_per_25": [round(float(losses[i:i + 25].mean()), 3) for i in range(0, len(losses), 25)]}),
                  flush=True)


if __name__ == "__main__":
    main()
