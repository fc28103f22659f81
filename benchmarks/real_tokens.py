"""Training-step time of the demo's recipe on its real batches, the encoder layers' token-wise work on the real
tokens only (models.layers.Packing) against the padded batch, and how far apart their losses and gradients are.
A batch pads its sequences to the longest text and the most regions of any of its examples: about a third of the
stage's token slots are padding. The same batches, contenders taking turns, median seconds per step per task, and
the mix's mean step weighted by the stage's task weights.

    python benchmarks/real_tokens.py [--batches 12] [--threads 2] [--no-write]
"""
from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from encoder import cpu_name, write_section  # noqa: E402

from models import layers  # noqa: E402
from models.tokenizer import VLTokenizer  # noqa: E402
from region_slots import demo_stage, step_args  # noqa: E402
from training.data.vl_tasks import collate  # noqa: E402
from training.finetune import autocast, batch_loss, collate_kind, head_of, pairs_per_example, param_groups  # noqa: E402

HEADING = "## Training step: real tokens only"
PACKED = layers.Packing.worthwhile


def main() -> None:
    args = step_args(__doc__)
    stage, data, model = demo_stage(weights=True)  # the multi-task checkpoint: real attention, real losses
    opt = torch.optim.AdamW(param_groups(model, stage), lr=0.0, foreach=True)  # lr 0: every step sees the same weights
    tokenizer = VLTokenizer.pretrained_minilm(max_length=stage.max_length)
    rng = np.random.default_rng(0)
    times = {t: {"padded": [], "packed": []} for t in stage.tasks}
    real = {t: [] for t in stage.tasks}
    loss_gap, grad_gap = 0.0, 0.0
    for task in stage.tasks:
        pool, head = data.train[task], head_of(task, stage.rank_pool)
        group, kind = pairs_per_example(task, pool), collate_kind(model, task, head)
        for b in range(args.batches + 1):  # the first batch warms up
            batch = [pool[int(i)] for i in rng.integers(0, len(pool), max(1, stage.batch_size // group))]
            inputs, labels = collate(kind, batch, data.train_table, tokenizer, model.config.heads[head])
            found = {}
            for name in (("padded", "packed") if b % 2 else ("packed", "padded")):
                layers.Packing.worthwhile = PACKED if name == "packed" else staticmethod(lambda mask: False)
                start = time.perf_counter()
                with autocast(stage.bf16):
                    loss = batch_loss(model, task, head, inputs, labels, group)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), stage.clip)
                opt.step()
                if b:
                    times[task][name].append(time.perf_counter() - start)
                found[name] = (loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
            layers.Packing.worthwhile = PACKED
            loss_gap = max(loss_gap, abs(found["packed"][0] - found["padded"][0]))
            g, h = found["packed"][1], found["padded"][1]
            grad_gap = max(grad_gap, ((g - h).norm() / h.norm()).item())
            slots = inputs.attention_mask.numel() + inputs.region_mask.numel()
            real[task].append((inputs.attention_mask.sum() + inputs.region_mask.sum()).item() / slots)
    weights = np.array([stage.tasks[t] for t in stage.tasks]) / sum(stage.tasks.values())
    rows, mean = [], {"padded": 0.0, "packed": 0.0}
    for w, task in zip(weights, stage.tasks):
        med = {k: statistics.median(v) for k, v in times[task].items()}
        for k in mean:
            mean[k] += w * med[k]
        rows.append(f"| {task} | {statistics.mean(real[task]):.2f} | {med['padded'] * 1000:.0f} | {med['packed'] * 1000:.0f} "
                    f"| {med['padded'] / med['packed']:.2f}x |")
    rows.append(f"| **the stage's mix** (weighted) | | {mean['padded'] * 1000:.0f} | {mean['packed'] * 1000:.0f} "
                f"| **{mean['padded'] / mean['packed']:.2f}x** |")
    text = "\n".join([
        HEADING, "",
        f"`python benchmarks/real_tokens.py --batches {args.batches} --threads {args.threads}` "
        f"({datetime.date.today()}, {cpu_name()}, {args.threads} threads, bf16 autocast, the demo's multi-task checkpoint "
        f"and heads on the demo's training batches; a whole step: forward, backward, clipping, foreach AdamW; median ms "
        f"per step of {args.batches} batches per task, both ways on the same batches, taking turns):", "",
        "| task | real share of the token slots | padded | real tokens only | speed-up |", "|---|---|---|---|---|", *rows,
        "", f"Largest gap between the two on the same batch: loss {loss_gap:.1e}, gradient {grad_gap:.1e} (relative norm; "
            "bf16 autocast rounds each GEMM, so a GEMM of other rows may round differently).",
    ])
    print(text)
    if not args.no_write:
        write_section(ROOT / "docs" / "BENCHMARKS.md", text, HEADING)


if __name__ == "__main__":
    main()
