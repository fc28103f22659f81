"""Are a checkpoint's retrieval scores comparable across images? Text -> image over the val pool with the model's
retrieval head (training.retrieval.retrieval_head): how often one image is the top-1 of several captions (a "hub"),
and gold R@1 of the query captions before and after an inverted softmax over a bank of other captions (each image's
score normalised by how it scores against the bank; Smith et al. 2017, Bogolin et al. 2022's query-bank
normalisation). Here the bank is other val captions (an optimistic bank: they include the pool images' own
listings); models.query_bank is the served form, with a bank of training captions, and
benchmarks/query_bank_sweep.py measures it (docs/RESULTS.md, sessions 19 and 20).

    python benchmarks/retrieval_hubness.py [--model-dir CKPT] [--detector-dir DET] [--pool 500] [--queries 100] [--bank 100]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
from models.checkpoint import load_checkpoint  # noqa: E402
from models.query_bank import image_prior, normalised  # noqa: E402
from training.finetune import gemm_precision  # noqa: E402
from training.retrieval import itm_scorer, query_sample, retrieval_head, score_grid  # noqa: E402
from training.vl_data import prepare_eval_data  # noqa: E402
from training.zoo import zoo_dir  # noqa: E402


def inverted_softmax(scores: torch.Tensor, bank: torch.Tensor, temperature: float) -> torch.Tensor:
    """models.query_bank's normalisation: (Q, N) scores, (B, N) bank scores -> (Q, N) log shares."""
    return torch.from_numpy(normalised(scores.numpy(), image_prior(bank.numpy(), temperature), temperature))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=zoo_dir("demo") / "encoder")
    ap.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    ap.add_argument("--pool", type=int, default=500, help="val images ranked")
    ap.add_argument("--queries", type=int, default=100, help="listing captions scored")
    ap.add_argument("--bank", type=int, default=100, help="other listing captions each image is normalised by")
    args = ap.parse_args()
    ckpt = load_checkpoint(args.model_dir)
    data = prepare_eval_data(args.detector_dir, "val", args.pool, easy_vqa_images=0, retrieval_pool=args.pool, progress=False)
    examples = data.eval["retrieval"]
    texts = query_sample(len(examples), args.queries + args.bank, 0)
    shuffled = np.random.default_rng(1).permutation(texts)
    queries, bank = np.sort(shuffled[:args.queries]), np.sort(shuffled[args.queries:])
    scorer = itm_scorer(ckpt.model, retrieval_head(ckpt.model), examples, data.eval_table, ckpt.tokenizer)
    with gemm_precision(ckpt.model, "bf16"):
        grid = score_grid(scorer, np.concatenate([queries, bank]), np.arange(len(examples)))
    scores, bank_scores = grid[:len(queries)], grid[len(queries):]
    gold = torch.from_numpy(queries)
    r1 = lambda s: round((s.argmax(1) == gold).float().mean().item(), 4)  # noqa: E731
    tops = collections.Counter(scores.argmax(1).tolist())
    result = {"model": str(args.model_dir), "pool": len(examples), "queries": len(queries), "bank": len(bank),
              "distinct_top1_images": len(tops), "most_top1_per_image": tops.most_common(1)[0][1], "R@1": r1(scores),
              "R@1_inverted_softmax": {f"T={t:g}": r1(inverted_softmax(scores, bank_scores, t)) for t in (1, 2, 4)},
              "R@1_by_bank_size": {f"B={b},T={t:g}": r1(inverted_softmax(scores, bank_scores[:b], t))
                                   for b in (64, 128, 256, 384) if b < len(bank) for t in (0.5, 1, 2)}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
