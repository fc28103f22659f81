"""Scoring (caption, image) pairs with the demo's ranking head, which reads only the pooled vector: the whole last
layer against the last layer for the first token alone (SingleStreamEncoder's pooled_only, what VLModel runs for
such a head). The card's R@K and /retrieve's query bank are this scoring. Pairs: every bank caption with each of the
first N val images (the card's bank priors), batches of 256 pairs as training.retrieval scores them; the two ways take
turns; median seconds over the runs; the scores of both ways compared.

    python benchmarks/first_token.py [--images 100] [--runs 3] [--threads 2] [--precision bf16] [--no-write]
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

from models.checkpoint import load_checkpoint  # noqa: E402
from models.query_bank import QueryBank  # noqa: E402
from training.finetune import gemm_precision, run_data  # noqa: E402
from training.retrieval import retrieval_head, score_grid, text_scorer  # noqa: E402
from training.vl_data import tagged  # noqa: E402
from training.zoo import PROFILES, placed, zoo_dir  # noqa: E402

HEADING = "## Pair scoring: the last layer for the first token alone"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = zoo_dir("demo")
    stage = placed(PROFILES["demo"], root)["retrieval"]
    checkpoint = load_checkpoint(root / "encoder")
    model, tokenizer = checkpoint.model.eval(), checkpoint.tokenizer
    data = tagged(run_data(stage, False), model, tokenizer)
    bank = QueryBank.from_labels(checkpoint.labels)
    head = retrieval_head(model)
    rows = [e.rows[0] for e in data.eval["retrieval"][:args.images]]
    scorer = text_scorer(model, head, bank.texts, rows, data.eval_table, tokenizer)
    grid = lambda: score_grid(scorer, np.arange(len(bank.texts)), np.arange(len(rows)))  # noqa: E731
    kind = type(model.heads[head])
    fast = kind.pooled_only
    ways = {"whole last layer": property(lambda self: False), "first token alone": fast}
    times: dict[str, list[float]] = {name: [] for name in ways}
    scores = {}
    with gemm_precision(model, args.precision):
        grid()  # warm-up
        for run in range(args.runs):
            for name in (list(ways) if run % 2 == 0 else list(ways)[::-1]):
                kind.pooled_only = ways[name]
                start = time.perf_counter()
                scores[name] = grid()
                times[name].append(time.perf_counter() - start)
    kind.pooled_only = fast
    pairs = len(bank.texts) * len(rows)
    med = {name: statistics.median(t) for name, t in times.items()}
    whole, first = med["whole last layer"], med["first token alone"]
    gap = (scores["first token alone"] - scores["whole last layer"]).abs().max().item()
    text = "\n".join([
        HEADING, "",
        f"`python benchmarks/first_token.py --images {args.images} --runs {args.runs} --threads {args.threads} "
        f"--precision {args.precision}` ({datetime.date.today()}, {cpu_name()}, {args.threads} threads, "
        f"{args.precision} GEMMs; the served demo's ranking head ({head}, reads the pooled vector), its "
        f"{len(bank.texts)} bank captions with each of the first {args.images} val images: {pairs:,} pairs in batches "
        f"of 256; median of {args.runs} runs, taking turns):", "",
        "| last layer | seconds | pairs/s | speed-up |", "|---|---|---|---|",
        f"| whole (every token) | {whole:.1f} | {pairs / whole:.0f} | 1.00x |",
        f"| first token alone | {first:.1f} | {pairs / first:.0f} | **{whole / first:.2f}x** |",
        "", f"Largest gap between the two ways' scores: {gap:.1e} (match logit minus no-match logit; {args.precision} GEMMs "
            "over fewer rows may round differently, about bf16's resolution at these logits under bf16).",
    ])
    print(text)
    if not args.no_write:
        write_section(ROOT / "docs" / "BENCHMARKS.md", text, HEADING)


if __name__ == "__main__":
    main()
