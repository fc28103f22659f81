"""Text -> image R@1 of a checkpoint from several score rules over one scored grid: the ranking head's raw scores,
its query-bank normalised scores (models.query_bank), the ITM head's, and blends of them. Every rule reads the
same (queries + bank) x pool grid, scored once with both heads from one encoder pass per pair, so the rules
compare side by side; choose a rule on val, then read it on test.

    python benchmarks/retrieval_fusion.py [--model-dir CKPT] [--detector-dir DET] [--split val] [--pool 500]
        [--queries 100] [--save grid.npz | --load grid.npz]
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
from models import VLInputs  # noqa: E402
from models.checkpoint import load_checkpoint  # noqa: E402
from models.query_bank import QueryBank, image_prior, normalised  # noqa: E402
from training.evaluate import head_for  # noqa: E402
from training.finetune import gemm_precision  # noqa: E402
from training.retrieval import query_sample, retrieval_head, retrieval_recall  # noqa: E402
from training.vl_data import prepare_eval_data, tagged  # noqa: E402
from training.zoo import zoo_dir  # noqa: E402


def score_heads(model, heads: list[str], texts: list[str], rows: np.ndarray, table, tokenizer,
                batch_size: int = 256) -> np.ndarray:
    """(len(heads), len(texts), len(rows)) match scores (logit of match minus no match), one encoder pass per pair."""
    enc = tokenizer.encode(list(texts), max_length=tokenizer.max_length)
    lengths = enc["attention_mask"].sum(1)
    t_all, i_all = np.repeat(np.arange(len(texts)), len(rows)), np.tile(np.arange(len(rows)), len(texts))
    out = np.empty((len(heads), len(t_all)), np.float32)
    model.eval()
    with torch.inference_mode():
        for s in range(0, len(t_all), batch_size):
            t, i = t_all[s : s + batch_size], rows[i_all[s : s + batch_size]]
            width = int(lengths[t].max())
            inputs = VLInputs(input_ids=torch.from_numpy(enc["input_ids"][t, :width]),
                              attention_mask=torch.from_numpy(enc["attention_mask"][t, :width]),
                              token_type_ids=torch.from_numpy(enc["token_type_ids"][t, :width]),
                              **table.tensors(i, table.width(i)))
            features = None
            for h, name in enumerate(heads):
                head = model.heads[name]
                prepared = head.prepare(inputs)
                if features is None or prepared is not inputs:
                    features = model.forward_features(prepared)
                logits = head.unprepare(model.forward_head(name, features, prepared), inputs).float()
                out[h, s : s + len(t)] = (logits[:, 1] - logits[:, 0]).numpy()
    return out.reshape(len(heads), len(texts), len(rows))


def zscore(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / (x.std() + 1e-9)


def rules(rank: np.ndarray, rank_bank: np.ndarray, itm: np.ndarray, itm_bank: np.ndarray, query_tokens: np.ndarray,
          bank_tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Named (Q, pool) score matrices, higher = better."""
    out: dict[str, np.ndarray] = {"rank raw": rank, "itm raw": itm}
    for delta in (2, 4, 8):  # each query normalised by the bank captions of about its own length (at least 8 of them)
        by_length = np.empty_like(rank)
        for n, length in enumerate(query_tokens):
            near = np.argsort(np.abs(bank_tokens - length), kind="stable")
            rows = near[:max(8, int((np.abs(bank_tokens - length) <= delta).sum()))]
            by_length[n] = normalised(rank[n], image_prior(rank_bank[rows], 2.0), 2.0)
        out[f"rank bank T2, captions within {delta} tokens of the query's length"] = by_length
    for t in (1.0, 2.0, 4.0):
        p = image_prior(rank_bank, t)
        out[f"rank bank T{t:g}"] = normalised(rank, p, t)
        for a in (0.25, 0.5, 0.75):
            out[f"rank s/T - {a:g} prior, T{t:g}"] = rank / t - a * p
        pi = image_prior(itm_bank, t)
        out[f"itm bank T{t:g}"] = normalised(itm, pi, t)
    rb2 = normalised(rank, image_prior(rank_bank, 2.0), 2.0)
    ib2 = normalised(itm, image_prior(itm_bank, 2.0), 2.0)
    for w in (0.25, 0.5, 1.0):
        out[f"rank raw + {w:g} itm raw (z)"] = zscore(rank) + w * zscore(itm)
        out[f"rank bank T2 + {w:g} itm bank T2"] = rb2 + w * ib2
        out[f"rank bank T2 + {w:g} itm raw (z)"] = zscore(rb2) + w * zscore(itm)
    for k in (3, 5, 10, 20):  # the raw top-k, re-ranked by the bank
        top = np.argsort(-rank, axis=1)[:, :k]
        keep = np.full_like(rank, -np.inf)
        np.put_along_axis(keep, top, np.take_along_axis(rb2, top, 1), 1)
        out[f"raw top-{k} re-ranked by bank T2"] = keep
    return out


def recall(scores: np.ndarray, q: np.ndarray, keys: np.ndarray) -> dict[str, float]:
    """The project's R@1 / R@5 (gold image) and any-fitting R@1 of one rule's (Q, pool) matrix."""
    found = retrieval_recall(lambda t, i: torch.from_numpy(scores[np.searchsorted(q, t), i]), scores.shape[1], len(q),
                             keys=list(keys), ks=(1, 5), directions=("text_to_image",))
    return {"R@1": round(found["text_to_image"]["R@1"], 3), "R@5": round(found["text_to_image"]["R@5"], 3),
            "any_true_R@1": round(found["text_to_image_any_true"]["R@1"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=zoo_dir("demo") / "encoder")
    ap.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    ap.add_argument("--split", default="val", choices=("val", "test"))
    ap.add_argument("--pool", type=int, default=500, help="the split's first scenes, one listing caption each")
    ap.add_argument("--queries", type=int, default=100, help="listing captions ranking the pool (query_sample, seed 0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--save", type=Path, default=None, help="write the scored grids (.npz)")
    ap.add_argument("--load", type=Path, default=None, help="read grids written by --save instead of scoring")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.load:
        saved = np.load(args.load)
        grid, q, keys, meta = saved["grid"], saved["q"], saved["keys"], json.loads(str(saved["meta"]))
        tokens = saved["tokens"]
    else:
        ckpt = load_checkpoint(args.model_dir)
        model, tokenizer = ckpt.model, ckpt.tokenizer
        bank = QueryBank.from_labels(ckpt.labels)
        if bank is None:
            raise SystemExit(f"{args.model_dir} has no query bank")
        data = tagged(prepare_eval_data(args.detector_dir, args.split, args.pool, easy_vqa_images=0,
                                        retrieval_pool=args.pool, progress=False), model, tokenizer)
        examples = data.eval["retrieval"]
        q = query_sample(len(examples), args.queries, 0)
        keys = np.array([str(e.label) for e in examples])
        heads = [retrieval_head(model), head_for(model, "itm")]
        texts = [examples[i].text for i in q] + list(bank.texts)
        tokens = tokenizer.encode(texts, max_length=tokenizer.max_length)["attention_mask"].sum(1)
        with gemm_precision(model, "bf16"):
            grid = score_heads(model, heads, texts, np.array([e.rows[0] for e in examples]), data.eval_table, tokenizer)
        meta = {"model": str(args.model_dir), "split": args.split, "heads": heads, "queries": len(q),
                "bank": len(bank.texts), "score_seconds": round(time.perf_counter() - started, 1)}
        if args.save:
            np.savez(args.save, grid=grid, q=q, keys=keys, tokens=tokens, meta=json.dumps(meta))
    nq = len(q)
    named = rules(grid[0, :nq], grid[0, nq:], grid[1, :nq], grid[1, nq:], tokens[:nq], tokens[nq:])
    result = {**meta, "pool": grid.shape[2], "rules": {n: recall(s, q, keys) for n, s in named.items()}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
