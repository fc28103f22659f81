"""Text -> image R@1 of a checkpoint's retrieval head with query banks of several sizes and temperatures
(models.query_bank), over one pool: the same queries and one scored grid for every setting, so the settings
compare side by side. The banks are nested draws of listing captions of the first --train-scenes training scenes
(what a retrieval stage with --query-bank keeps); the checkpoint's own bank, if any, is not used.

    python benchmarks/query_bank_sweep.py [--model-dir CKPT] [--detector-dir DET] [--split test] [--pool 1000]
        [--queries 100] [--banks 64,128,256] [--temperatures 0.5,1,2]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
from models.checkpoint import load_checkpoint  # noqa: E402
from models.query_bank import image_prior  # noqa: E402
from training.data.shapes_cache import ShapesSplit, load_split  # noqa: E402
from training.data.vl_tasks import retrieval_examples  # noqa: E402
from training.finetune import gemm_precision  # noqa: E402
from training.retrieval import query_sample, retrieval_head, retrieval_recall, score_grid, text_scorer, training_bank  # noqa: E402
from training.vl_data import prepare_eval_data, tagged  # noqa: E402
from training.zoo import DEMO, zoo_dir  # noqa: E402


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=zoo_dir("demo") / "encoder")
    ap.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    ap.add_argument("--split", default="test", choices=("val", "test"))
    ap.add_argument("--pool", type=int, default=1000, help="the split's first scenes, one listing caption each")
    ap.add_argument("--queries", type=int, default=100, help="listing captions ranking the pool (query_sample, seed 0)")
    ap.add_argument("--banks", default="64,128,256", help="bank sizes (nested: each bank holds the smaller ones)")
    ap.add_argument("--temperatures", default="0.5,1,2")
    ap.add_argument("--train-scenes", type=int, default=DEMO.train_scenes)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--save", type=Path, default=None, help="also write the scored grids (.npz) for later analysis")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes, temperatures = sorted(int(b) for b in floats(args.banks)), floats(args.temperatures)
    ckpt = load_checkpoint(args.model_dir)
    model, tokenizer = ckpt.model, ckpt.tokenizer
    data = tagged(prepare_eval_data(args.detector_dir, args.split, args.pool, easy_vqa_images=0,
                                    retrieval_pool=args.pool, progress=False), model, tokenizer)
    examples = data.eval["retrieval"]
    train = load_split("train")
    listings = retrieval_examples(ShapesSplit(train.directory, train.annotations[:args.train_scenes], []))
    bank = training_bank(listings, sizes[-1], 1.0).texts
    order = np.random.default_rng(0).permutation(len(bank))  # nested banks: prefixes of one shuffled draw
    q = query_sample(len(examples), args.queries, 0)
    texts = [examples[i].text for i in q] + list(bank)
    started = time.perf_counter()
    head = retrieval_head(model)
    with gemm_precision(model, "bf16"):
        grid = score_grid(text_scorer(model, head, texts, [e.rows[0] for e in examples], data.eval_table, tokenizer),
                          np.arange(len(texts)), np.arange(len(examples)))
    queries, bank_grid = grid[:len(q)], grid[len(q):].numpy()
    if args.save:
        np.savez(args.save, queries=queries.numpy(), bank=bank_grid, q=q, keys=np.array([str(k) for k in [e.label for e in examples]]))
    keys = [e.label for e in examples]

    def recall(priors: torch.Tensor | None, t: float) -> dict:
        found = retrieval_recall(lambda tt, i: queries[np.searchsorted(q, tt), i], len(examples), args.queries,
                                 keys=keys, ks=(1, 5), directions=("text_to_image",), priors=priors, temperature=t)
        return {"R@1": found["text_to_image"]["R@1"], "R@5": found["text_to_image"]["R@5"],
                "any_true_R@1": found["text_to_image_any_true"]["R@1"]}

    result = {"model": str(args.model_dir), "split": args.split, "pool": len(examples), "queries": len(q),
              "raw": recall(None, 1.0), "banks": {}}
    for b in sizes:
        for t in temperatures:
            priors = torch.from_numpy(image_prior(bank_grid[order[:b]], t))
            result["banks"][f"B={b},T={t:g}"] = recall(priors, t)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
