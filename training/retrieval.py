"""Image-text retrieval with an ITM head: R@1/5/10 text -> image and image -> text over a pool of images.

Caption i is the gold caption of pool image i. A single-stream model runs once per (caption, image) pair, so
scoring is the whole cost: each of `queries` captions ranks every pool image (text -> image) and each of
`queries` images ranks every pool caption (image -> text): 2 * queries * pool pairs. A pretraining checkpoint's
ITM head gives zero-shot retrieval the same way.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from models import RANK_HEAD, VLInputs, VLModel
from models.query_bank import QueryBank, image_prior, normalised
from models.tokenizer import VLTokenizer

from .data.region_table import RegionTable
from .data.vl_tasks import Example
from .device import model_device
from .evaluate import head_for
from .metrics import gold_ranks, recall_at_k

PairScorer = Callable[[np.ndarray, np.ndarray], torch.Tensor]  # (caption ids (P,), image ids (P,)) -> match scores (P,)
KS = (1, 5, 10)
DIRECTIONS = ("text_to_image", "image_to_text")


def score_grid(score_pairs: PairScorer, texts: np.ndarray, images: np.ndarray, batch_size: int = 256) -> torch.Tensor:
    """(len(texts), len(images)) scores of every caption with every image, batch_size pairs per call."""
    t, i = np.repeat(texts, len(images)), np.tile(images, len(texts))
    scores = [score_pairs(t[s : s + batch_size], i[s : s + batch_size]).float() for s in range(0, len(t), batch_size)]
    return torch.cat(scores).reshape(len(texts), len(images))


def query_sample(pool: int, queries: int | None, seed: int = 0) -> np.ndarray:
    """Sorted pool indices of the queries: all of the pool when queries is None or not smaller."""
    if queries is None or queries >= pool:
        return np.arange(pool)
    return np.sort(np.random.default_rng(seed).choice(pool, size=queries, replace=False))


def named(recall: dict[int, float]) -> dict[str, float]:
    return {f"R@{k}": round(r, 4) for k, r in recall.items()}


def at_k(ranks: torch.Tensor, ks: Sequence[int]) -> dict[str, float]:
    """R@K from gold ranks (0 = first)."""
    return named({k: (ranks < k).float().mean().item() for k in ks})


def retrieval_recall(score_pairs: PairScorer, pool: int, queries: int | None = 100, keys: Sequence | None = None,
                     ks: Sequence[int] = KS, seed: int = 0, batch_size: int = 256,
                     directions: Sequence[str] = DIRECTIONS, priors: torch.Tensor | None = None,
                     temperature: float = 1.0) -> dict:
    """R@K in each of `directions`, counting only the gold image / caption (the standard metric).

    priors (optional, one per pool image, models.query_bank.image_prior at `temperature`): text -> image ranks the
    query-bank normalised scores, as /retrieve does, and text_to_image_raw reports R@K of the raw scores.

    keys (optional, one per pool image): caption i is true of every image whose key equals keys[i]. Then also
    reports how many pool images each query caption is true of and R@K counting any true match as a hit.
    Each direction scores queries x pool pairs: asking for one halves the cost.
    """
    unknown = set(directions) - set(DIRECTIONS)
    if unknown or not directions:
        raise ValueError(f"retrieval directions must be among {', '.join(DIRECTIONS)}, got {list(directions)}")
    q = query_sample(pool, queries, seed)
    everything = np.arange(pool)
    result: dict = {"pool": pool, "queries": len(q)}
    true = None
    if keys is not None:
        ids = {key: n for n, key in enumerate(dict.fromkeys(keys))}
        key_id = torch.tensor([ids[key] for key in keys])
        true = key_id[q].unsqueeze(1) == key_id.unsqueeze(0)  # (Q, pool): query q's caption is true of image i,
        matches = true.sum(1).float()  # and image q is described by caption i (the same relation)
        result["true_images_per_caption"] = round(matches.mean().item(), 4)
        result["ambiguous_queries"] = int((matches > 1).sum())
    if "text_to_image" in directions:
        t2i = score_grid(score_pairs, q, everything, batch_size)  # (Q, pool): query captions rank every image
        if priors is not None:
            result["text_to_image_raw"] = named(recall_at_k(t2i, torch.from_numpy(q), ks)["text_to_image"])
            t2i = torch.from_numpy(normalised(t2i.numpy(), priors.numpy(), temperature))
        result["text_to_image"] = named(recall_at_k(t2i, torch.from_numpy(q), ks)["text_to_image"])
        if true is not None:
            result["text_to_image_any_true"] = at_k(gold_ranks(t2i, true), ks)
    if "image_to_text" in directions:
        i2t = score_grid(score_pairs, everything, q, batch_size)  # (pool, Q): query images rank every caption
        image_of_caption = torch.full((pool,), -1, dtype=torch.long)  # column of i2t holding caption t's image
        image_of_caption[torch.from_numpy(q)] = torch.arange(len(q))
        result["image_to_text"] = named(recall_at_k(i2t, image_of_caption, ks)["image_to_text"])
        if true is not None:
            result["image_to_text_any_true"] = at_k(gold_ranks(i2t.T, true), ks)
    return result


def itm_scorer(model: VLModel, task: str, examples: list[Example], table: RegionTable, tokenizer: VLTokenizer,
               max_length: int | None = None) -> PairScorer:
    """Match score (ITM logit of "match" minus "no match") of caption examples[t] with the image of examples[i]."""
    return text_scorer(model, task, [e.text for e in examples], [e.rows[0] for e in examples], table, tokenizer,
                       max_length)


def text_scorer(model: VLModel, task: str, texts: Sequence[str], image_rows: Sequence[int], table: RegionTable,
                tokenizer: VLTokenizer, max_length: int | None = None) -> PairScorer:
    """Match score (ITM logit of "match" minus "no match") of texts[t] with the image in table row image_rows[i]."""
    text = tokenizer.encode(list(texts), max_length=max_length or tokenizer.max_length)
    lengths = text["attention_mask"].sum(1)
    rows = np.asarray(image_rows)
    model.eval()
    device = model_device(model)

    @torch.inference_mode()
    def score(texts: np.ndarray, images: np.ndarray) -> torch.Tensor:
        width = int(lengths[texts].max())  # trim the padding no caption of this batch needs
        inputs = VLInputs(
            input_ids=torch.from_numpy(text["input_ids"][texts, :width]),
            attention_mask=torch.from_numpy(text["attention_mask"][texts, :width]),
            token_type_ids=torch.from_numpy(text["token_type_ids"][texts, :width]),
            **table.tensors(rows[images], table.width(rows[images])),  # padding no image of the batch needs is dropped
        )
        logits = model(inputs.to(device), task).logits.to("cpu", torch.float32)  # (P, 2), from the GPU if there
        return logits[:, 1] - logits[:, 0]

    return score


def training_bank(examples: Sequence[Example], size: int, temperature: float, seed: int = 0) -> QueryBank:
    """A query bank of `size` distinct captions of training examples (the ranking groups' listing captions), drawn
    with their own generator so the bank does not change the training run."""
    texts = list(dict.fromkeys(e.text for e in examples))
    if len(texts) < size:
        raise ValueError(f"a query bank of {size} captions needs as many distinct training captions, found {len(texts)}")
    picked = np.sort(np.random.default_rng([seed, 2022]).choice(len(texts), size=size, replace=False))
    return QueryBank(tuple(texts[i] for i in picked), temperature)


def pool_priors(model: VLModel, task: str, bank: QueryBank, image_rows: Sequence[int], table: RegionTable,
                tokenizer: VLTokenizer, batch_size: int = 256) -> torch.Tensor:
    """Each pool image's prior (models.query_bank.image_prior) from its scores with every bank caption."""
    scorer = text_scorer(model, task, bank.texts, image_rows, table, tokenizer)
    grid = score_grid(scorer, np.arange(len(bank.texts)), np.arange(len(image_rows)), batch_size)  # (B, pool)
    return torch.from_numpy(image_prior(grid.numpy(), bank.temperature))


def retrieval_head(model: VLModel) -> str | None:
    """The head retrieval ranks with: the ranking head where the model has one, else its ITM head."""
    if RANK_HEAD in model.heads and model.config.heads[RANK_HEAD].kind == "itm":
        return RANK_HEAD
    return head_for(model, "itm")


def evaluate_retrieval(model: VLModel, data, tokenizer: VLTokenizer, queries: int | None = 100, seed: int = 0,
                       batch_size: int = 256, directions: Sequence[str] = DIRECTIONS,
                       bank: QueryBank | None = None, pool: int | None = None) -> dict | None:
    """Retrieval over data.eval["retrieval"] (its first `pool` images; None = all) with the model's ranking or ITM
    head (retrieval_head); None without either. With a query bank, text -> image ranks the bank-normalised scores (as
    /retrieve does)."""
    examples = data.eval.get("retrieval")
    if examples and pool is not None:
        examples = examples[:pool]
    task = retrieval_head(model)
    if not examples or task is None:
        return None
    scorer = itm_scorer(model, task, examples, data.eval_table, tokenizer)
    priors = None
    if bank is not None and "text_to_image" in directions:
        priors = pool_priors(model, task, bank, [e.rows[0] for e in examples], data.eval_table, tokenizer, batch_size)
    result = retrieval_recall(scorer, len(examples), queries, keys=[e.label for e in examples], seed=seed,
                              batch_size=batch_size, directions=directions, priors=priors,
                              temperature=bank.temperature if bank else 1.0)
    if priors is not None:
        result["query_bank"] = {"captions": len(bank.texts), "temperature": bank.temperature}
    return result


def card_metrics(result: dict, direction: str = "text_to_image") -> dict[str, float]:
    """One direction of a retrieval result as flat metrics: retrieval_<t2i|i2t>_R@K (the gold image / caption) and,
    where the result has keys, retrieval_<t2i|i2t>_any_true_R@1 (any pool item the caption is true of counts)."""
    short = {"text_to_image": "t2i", "image_to_text": "i2t"}[direction]
    out = {"retrieval_pool": result["pool"], "retrieval_queries": result["queries"]}
    out.update({f"retrieval_{short}_{k}": v for k, v in result[direction].items()})
    if f"{direction}_any_true" in result:
        out[f"retrieval_{short}_any_true_R@1"] = result[f"{direction}_any_true"]["R@1"]
    if f"{direction}_raw" in result:  # ranked by the bank-normalised scores: the raw scores' R@1 beside them
        out[f"retrieval_{short}_raw_R@1"] = result[f"{direction}_raw"]["R@1"]
        out["retrieval_query_bank"] = result["query_bank"]["captions"]
    return out
