"""Training-step time of a small encoder under the levers that decide how many examples the demo's 10-minute budget
holds: bf16 autocast, a frozen word-embedding table (no dense AdamW update of 30522 x H every step), foreach
AdamW, the region count, and dropout (CPU dropout draws a random mask per element). One process, contenders taking
turns, median of several timed steps each.

    python benchmarks/train_step.py [--preset u-visualbert] [--batch 32] [--text 16] [--runs 5] [--no-write]
    python benchmarks/train_step.py --threads 1 2 --no-write   # each contender at each thread count, taking turns
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Hashable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from encoder import cpu_name, write_section  # noqa: E402

from models import HeadConfig, VLInputs, create_model  # noqa: E402

HEADING = "## Training step: the levers of the demo's time budget"
# name -> (bf16, freeze word embeddings, AdamW implementation (plain: one update per tensor), regions, dropout)
CONTENDERS = {
    "fp32, 16 regions": (False, False, "plain", 16, 0.1),
    "fp32, frozen word embeddings": (False, True, "plain", 16, 0.1),
    "fp32, foreach AdamW": (False, False, "foreach", 16, 0.1),
    "bf16": (True, False, "plain", 16, 0.1),
    "bf16 + frozen + foreach": (True, True, "foreach", 16, 0.1),
    "bf16 + frozen + foreach, 8 regions": (True, True, "foreach", 8, 0.1),
    "bf16 + frozen + foreach, 8 regions, no dropout": (True, True, "foreach", 8, 0.0),
    # fused AdamW (training.finetune.adamw): one kernel per parameter for weights, gradient and both moments
    "bf16 + frozen + fused, 8 regions, no dropout": (True, True, "fused", 8, 0.0),
    # the demo's recipe on a CPU without native bf16, where training falls back to float32 (training.finetune.train_precision)
    "fp32 + frozen + fused, 8 regions, no dropout": (False, True, "fused", 8, 0.0),
}


def contender(preset: str, layers: int, batch: int, text: int, bf16: bool, freeze: bool, optimizer: str, regions: int,
              dropout: float):
    torch.manual_seed(0)
    model = create_model(preset, "small", num_layers=layers, heads={"vqa": HeadConfig(kind="vqa", num_labels=30, vqa_loss="ce")},
                         visual_feat_dim=512, feature_norm=True, dropout=dropout, attention_dropout=dropout)
    model.train()
    if freeze:
        model.encoder.embeddings.word_embeddings.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            **{"plain": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[optimizer])
    g = torch.Generator().manual_seed(0)
    inputs = VLInputs(torch.randint(1000, 2000, (batch, text), generator=g), torch.ones(batch, text, dtype=torch.long),
                      torch.zeros(batch, text, dtype=torch.long), torch.randn(batch, regions, 512, generator=g),
                      torch.rand(batch, regions, 4, generator=g).sort(-1).values, torch.ones(batch, regions, dtype=torch.long))
    labels = torch.zeros(batch, 30)
    labels[:, 3] = 1.0

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model(inputs, "vqa", labels).loss

    return timed_step(loss, opt)


def timed_step(loss: Callable[[], torch.Tensor], opt: torch.optim.Optimizer) -> Callable[[], float]:
    """A function that runs one training step (loss, backward, optimizer) and returns its seconds."""
    def step() -> float:
        start = time.perf_counter()
        value = loss()
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        return time.perf_counter() - start

    return step


def take_turns(steps: dict[Hashable, Callable[[], float]], runs: int, warmup: int = 2) -> dict[Hashable, float]:
    """Median seconds per step of each contender: warm-up steps, then contenders taking turns, so that a busy
    moment of the machine hits every one of them."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(runs):
        for name, step in steps.items():
            times[name].append(step())
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="u-visualbert")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--text", type=int, default=16, help="text tokens")
    p.add_argument("--num-layers", type=int, default=6, help="encoder layers (the demo keeps 4 of MiniLM's 6)")
    p.add_argument("--runs", type=int, default=5, help="timed steps per contender (after 2 warm-up steps)")
    p.add_argument("--threads", type=int, nargs="+", default=[2],
                   help="torch threads; several counts time each contender at each, taking turns (printed, not written)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads[0])
    steps = {name: contender(args.preset, args.num_layers, args.batch, args.text, *levers) for name, levers in CONTENDERS.items()}
    command = (f"python benchmarks/train_step.py --preset {args.preset} --num-layers {args.num_layers} --batch {args.batch} "
               f"--text {args.text} --runs {args.runs}")
    described = (f"One training step (forward, backward, AdamW) of `{args.preset}` small (hidden 384, {args.num_layers} "
                 f"layers) with a VQA head, batch {args.batch}, {args.text} text tokens, random inputs; median of {args.runs} "
                 "steps per contender, taking turns.")
    if len(args.threads) > 1:
        counts = args.threads
        medians = take_turns({(name, n): on_threads(n, step) for name, step in steps.items() for n in counts}, args.runs)
        rows = [f"| {name} | " + " | ".join(f"{medians[name, n] * 1000:.0f}" for n in counts)
                + f" | **{medians[name, counts[0]] / medians[name, counts[-1]]:.2f}x** |" for name in steps]
        header = (f"| contender | {' | '.join(f'ms per step, {n} thread' + 's' * (n > 1) for n in counts)} | {counts[-1]} threads "
                  f"against {counts[0]} |")
        publish(f"{command} --threads {' '.join(map(str, counts))}", " / ".join(map(str, counts)), described,
                [header, "|---" * (len(counts) + 2) + "|", *rows], HEADING, False)
        return
    medians = take_turns(steps, args.runs)
    base = medians[next(iter(CONTENDERS))]
    rows = [f"| {name} | {t * 1000:.0f} | **{base / t:.2f}x** | {args.batch / t:.0f} |" for name, t in medians.items()]
    publish(command, args.threads[0], described,
            ["| contender | ms per step | speed-up | examples/s |", "|---|---|---|---|", *rows], HEADING, not args.no_write)


def on_threads(threads: int, step: Callable[[], float]) -> Callable[[], float]:
    """The step run with `threads` torch threads (the pool is resized before each step, outside its timing)."""
    def run() -> float:
        torch.set_num_threads(threads)
        return step()

    return run


def publish(command: str, threads: int | str, description: str, table: list[str], heading: str, write: bool) -> None:
    """Print the section (command, date, machine, load, what was timed, the table) and replace it in docs/BENCHMARKS.md."""
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    section = "\n".join([
        f"Command: `{command}` · {datetime.date.today()} · {cpu_name()}, {threads} threads, load average after the runs "
        f"{load} · torch {torch.__version__}.",
        "", description, "", *table,
    ])
    print(section)
    if write:
        write_section(ROOT / "docs" / "BENCHMARKS.md", f"{heading}\n\n{section}", heading)

if __name__ == "__main__":
    main()
