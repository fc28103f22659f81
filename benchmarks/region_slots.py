"""Training-step time of the demo's recipe on its real batches, with each batch's region slots cut to the most any
of its images holds (training.data.vl_tasks.collate) against the same batches padded to the
detector's 8 slots. The demo keeps the regions with confidence >= 0.3, 1 to 8 per image (3.4 on average), so most
slots of a fully padded batch are padding. The same batches, contenders taking turns, median seconds per step per
task, and the mix's mean step weighted by the stage's task weights.

    python benchmarks/region_slots.py [--batches 12] [--threads 2] [--no-write]
"""
from __future__ import annotations

import argparse
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

from models.tokenizer import VLTokenizer  # noqa: E402
from training.data.region_table import RegionTable  # noqa: E402
from training.data.vl_tasks import collate  # noqa: E402
from training.finetune import (  # noqa: E402
    autocast, batch_loss, build_model, collate_kind, head_of, init_from_checkpoint, pairs_per_example, param_groups,
    run_data,
)
from training.zoo import MULTITASK, PROFILES, placed, zoo_dir  # noqa: E402

HEADING = "## Training step: region slots cut to the batch"


class Padded(RegionTable):
    """The same table, batched with all of the detector's region slots (what collate did before it cut them)."""

    def width(self, rows) -> int:
        return self.mask.shape[1]


def step_args(doc: str) -> argparse.Namespace:
    """The training-step benchmarks' options (--batches, --threads, --no-write); sets torch's threads."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--batches", type=int, default=12, help="timed batches per task (each run both ways)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def demo_stage(weights: bool = False):
    """(config, data, model in training mode with its word table frozen) of the demo's retrieval stage, from the built
    demo's multi-task checkpoint: its weights too where `weights` (real losses and gradients), else a fresh model."""
    multitask = zoo_dir("demo") / MULTITASK
    stage = placed(PROFILES["demo"], zoo_dir("demo"))["retrieval"]
    data = run_data(stage, False)
    model = build_model(stage, data.feature_dim, len(data.answers)).train()
    if weights:
        init_from_checkpoint(model, multitask)
    model.encoder.embeddings.word_embeddings.weight.requires_grad_(False)
    return stage, data, model


def main() -> None:
    args = step_args(__doc__)
    stage, data, model = demo_stage()
    opt = torch.optim.AdamW(param_groups(model, stage), lr=1e-5, foreach=True)
    tokenizer = VLTokenizer.pretrained_minilm(max_length=stage.max_length)
    tables = {"cut": data.train_table, "padded": Padded(**vars(data.train_table))}
    rng = np.random.default_rng(0)
    times: dict[str, dict[str, list[float]]] = {t: {"cut": [], "padded": []} for t in stage.tasks}
    slots: dict[str, list[int]] = {t: [] for t in stage.tasks}
    for task in stage.tasks:
        pool, head = data.train[task], head_of(task, stage.rank_pool)
        group, kind = pairs_per_example(task, pool), collate_kind(model, task, head)
        for b in range(args.batches + 1):  # the first batch warms up
            batch = [pool[int(i)] for i in rng.integers(0, len(pool), max(1, stage.batch_size // group))]
            order = ("cut", "padded") if b % 2 else ("padded", "cut")
            for name in order:
                inputs, labels = collate(kind, batch, tables[name], tokenizer, model.config.heads[head])
                start = time.perf_counter()
                with autocast(stage.bf16):
                    loss = batch_loss(model, task, head, inputs, labels, group)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if b:
                    times[task][name].append(time.perf_counter() - start)
                    if name == "cut":
                        slots[task].append(int(inputs.region_mask.shape[-1]))
    weights = np.array([stage.tasks[t] for t in stage.tasks]) / sum(stage.tasks.values())
    rows, mean = [], {"cut": 0.0, "padded": 0.0}
    for w, task in zip(weights, stage.tasks):
        med = {k: statistics.median(v) for k, v in times[task].items()}
        for k in mean:
            mean[k] += w * med[k]
        rows.append(f"| {task} | {statistics.mean(slots[task]):.1f} | {med['padded'] * 1000:.0f} | {med['cut'] * 1000:.0f} "
                    f"| {med['padded'] / med['cut']:.2f}x |")
    rows.append(f"| **the stage's mix** (weighted) | | {mean['padded'] * 1000:.0f} | {mean['cut'] * 1000:.0f} "
                f"| **{mean['padded'] / mean['cut']:.2f}x** |")
    text = "\n".join([
        HEADING, "",
        f"`python benchmarks/region_slots.py --batches {args.batches} --threads {args.threads}` "
        f"({datetime.date.today()}, {cpu_name()}, {args.threads} threads, bf16 autocast, the demo's encoder and heads "
        f"on the demo's training batches; median ms per step of {args.batches} batches per task, both ways on the same "
        "batches, taking turns):", "",
        "| task | slots per batch, cut (of 8) | padded to 8 | cut | speed-up |", "|---|---|---|---|---|", *rows,
    ])
    print(text)
    if not args.no_write:
        write_section(ROOT / "docs" / "BENCHMARKS.md", text, HEADING)


if __name__ == "__main__":
    main()
