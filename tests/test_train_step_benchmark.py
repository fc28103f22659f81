"""benchmarks/train_step.py with several thread counts (`--threads 1 2`): each contender's steps run at each count,
the counts taking turns, so that one run says how the training step scales from one core to two (docs/RESULTS.md,
the demo build's time by CPU kind)."""
from __future__ import annotations

from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_each_thread_count_runs_its_own_steps_in_turn(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import train_step

    seen: list[int] = []

    def step() -> float:
        seen.append(torch.get_num_threads())
        return 0.01 * torch.get_num_threads()

    before = torch.get_num_threads()
    try:
        medians = train_step.take_turns({("demo", n): train_step.on_threads(n, step) for n in (1, 2)}, runs=3, warmup=1)
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2] + [1, 2] * 3  # one warm-up step each, then the counts taking turns
    assert medians == {("demo", 1): 0.01, ("demo", 2): 0.02}
