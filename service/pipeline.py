"""What happens between a validated request and its answer, free of HTTP and of torch.

images -> RegionService (feature store, batched detector) · text -> tokenizer within the limits · one item
(numpy arrays of one example) -> the task's Batcher, whose batch function pads the items and calls the
runtime · logits -> answers, boxes, rankings (small pure functions below, tested directly).

Retrieval on a runtime that splits the streams (two-stream presets on torch) submits `Pair` items instead:
its batch function takes each side's states from the StreamCache (encoding the misses) and fuses the pairs.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models import RANK_HEAD
from models.config import HeadConfig
from models.images import ImageError
from models.region_features import RegionFeatures, region_tag_ids, stack
from models.tokenizer import VLTokenizer

from .batcher import Batcher
from .collate import pad_and_stack
from .errors import InvalidInput, NoHeadError, shown
from .explain import Explainer, explain_pairs
from .query_bank import BankPriors
from .regions import RegionService
from .runtime.base import Runtime
from .stream_cache import Pair, StreamCache

SERVED_KINDS = ("vqa", "refer", "itm", "nlvr2")  # head kinds that answer an endpoint
ENDPOINT_OF = {"vqa": "/vqa", "refer": "/refer", "itm": "/retrieve", "nlvr2": "/nlvr2"}
RUNNER_UP = 4  # regions listed after the best one by /refer

Item = dict[str, np.ndarray]  # one example, no batch axis


# ---- post-processing (pure) -----------------------------------------------------------------------

def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60, 60)))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def top_answers(logits: np.ndarray, names: Sequence[str], k: int, score: str = "sigmoid") -> list[tuple[str, float]]:
    """(answer, score) of the k best answers, best first; `score` is the head's (HeadConfig.score): "sigmoid" per
    answer or "softmax" over the answers."""
    order = best(logits, k)
    if score == "softmax":
        scores = softmax(logits.astype(np.float64))[order]
    else:
        scores = sigmoid(logits[order].astype(np.float64))
    return [(names[i], float(v)) for i, v in zip(order, scores)]


def located(exc: ImageError, *loc: str | int) -> ImageError:
    """The error with `loc`, the request field of the image (a new exception: concurrent requests for the same bytes
    share one detection and its error)."""
    error = ImageError(str(exc))
    error.loc = loc
    return error


def best(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first, ties by index (a stable sort's order) without sorting them all:
    a public VQA head has 3129 answers and a request wants a few."""
    n = len(values)
    candidates = np.arange(n)
    if k < n:  # every value tied with the k-th largest stays a candidate, so ties resolve as in a full sort
        candidates = np.flatnonzero(values >= np.partition(values, n - k)[n - k])
    return candidates[np.lexsort((candidates, -values[candidates]))][:k]


def ranked_regions(logits: np.ndarray, num_boxes: int, k: int) -> list[tuple[int, float]]:
    """(region index, softmax score over the real regions) of the k best regions, best first."""
    real = logits[:num_boxes].astype(np.float64)
    probs = softmax(real)
    order = np.argsort(-real, kind="stable")[:k]
    return [(int(i), float(probs[i])) for i in order]


def match_scores(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ITM (K, 2) [no match, match] logits -> (score = logit difference, probability of match)."""
    diff = (logits[:, 1] - logits[:, 0]).astype(np.float64)
    return diff, sigmoid(diff)  # softmax over two classes = sigmoid of the difference


def rank(scores: np.ndarray, k: int) -> list[int]:
    """Indices of the k highest scores, best first; ties keep the request's order."""
    return [int(i) for i in np.argsort(-scores, kind="stable")[:k]]


def detected_regions(rf: RegionFeatures, classes: Sequence[str], attributes: Sequence[str]) -> list[dict[str, Any]]:
    """The real regions of an image as the detector labelled them, most confident first."""
    name = lambda names, i: names[i] if 0 <= i < len(names) else str(i)  # noqa: E731
    return [{"index": i, "box": [round(float(v), 2) for v in rf.boxes[i]],
             "label": name(classes, int(rf.obj_ids[i])), "score": round(float(rf.obj_scores[i]), 4),
             "attribute": name(attributes, int(rf.attr_ids[i])), "attribute_score": round(float(rf.attr_scores[i]), 4)}
            for i in range(rf.num_boxes)]


def true_probability(logits: np.ndarray) -> float:
    """NLVR2 (2,) [false, true] logits -> P(true)."""
    return float(softmax(logits.astype(np.float64))[1])


# ---- per-request bookkeeping ------------------------------------------------------------------------

@dataclass
class Timer:
    """Per-stage wall time (ms) of one request; a stage that runs several times adds up."""

    stages: dict[str, float] = field(default_factory=dict)
    cache_hit: bool | None = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds * 1000

    def hit(self, cached: bool) -> None:
        self.cache_hit = cached if self.cache_hit is None else (self.cache_hit and cached)


@dataclass(frozen=True)
class Scored:
    """One item's logits and when the batch it ran in started and ended (perf_counter seconds)."""

    logits: np.ndarray
    started: float
    ended: float


@dataclass(frozen=True)
class TaskSpec:
    task: str  # head name in the checkpoint
    kind: str  # head kind (vqa, refer, itm, nlvr2)
    answer_slot: bool | str = False  # the tokenizer's answer_slot for the head's text layout (HeadConfig.answer_slot)
    labels: tuple[str, ...] = ()  # VQA answer names
    score: str = "sigmoid"  # VQA answer scores from the logits (HeadConfig.score)


@dataclass(frozen=True)
class Limits:
    max_text_chars: int
    max_text_tokens: int
    max_top_k: int
    max_candidates: int


def task_specs(tasks: dict[str, str], heads: Mapping[str, HeadConfig], labels: dict[str, Any]) -> dict[str, TaskSpec]:
    """kind -> TaskSpec for every served kind the model has: the first head of a kind answers its endpoint, except
    that /retrieve ranks with the ranking head (RANK_HEAD) where the model has one beside its ITM classifier. Text
    layout and answer scores are what `heads` (the model's HeadConfigs) declare; a task without one is plain text
    scored by sigmoids."""
    specs: dict[str, TaskSpec] = {}
    ranked = sorted(tasks.items(), key=lambda item: item[0] != RANK_HEAD or item[1] != "itm")  # stable: RANK_HEAD first
    for task, kind in ranked:
        if kind not in SERVED_KINDS or kind in specs:
            continue
        names = tuple((labels.get("heads") or {}).get(task) or ())
        head = heads.get(task)
        specs[kind] = TaskSpec(task, kind, answer_slot=head.answer_slot if head else False, labels=names,
                               score=(head.score if head else "") or "sigmoid")
    return specs


def batch_fn(runtime: Runtime, task: str) -> Callable[[list[Item]], list[Scored]]:
    """The synchronous function a task's Batcher runs in its executor: pad, run, split."""

    def run(items: list[Item]) -> list[Scored]:
        started = time.perf_counter()
        logits = runtime.run(task, pad_and_stack(items))
        ended = time.perf_counter()
        return [Scored(np.asarray(row), started, ended) for row in logits]

    return run


def fused_batch_fn(runtime: Runtime, task: str, cache: StreamCache) -> Callable[[list[Pair]], list[Scored]]:
    """The batch function of a task whose runtime splits the streams: cached states of each side, then fusion."""

    def run(pairs: list[Pair]) -> list[Scored]:
        started = time.perf_counter()
        texts = cache.fetch("text", [(p.text_key, p.text) for p in pairs], runtime.encode_texts)
        # an image's arrays are built only when its states are not cached
        images = cache.fetch("image", [(p.image_key, p.image) for p in pairs], runtime.encode_images,
                             lambda rf: region_arrays([rf]))
        logits = runtime.fuse(task, texts, images)
        ended = time.perf_counter()
        return [Scored(np.asarray(row), started, ended) for row in logits]

    return run


def region_arrays(images: Sequence[RegionFeatures], tag_words: np.ndarray | None = None) -> Item:
    """Encoder inputs of one image, or of an image pair (leading axis 2, NLVR2); with tag_words (detector class id
    -> word id), each region's class word as its tag, for encoders fine-tuned with region tags."""
    if len(images) == 1:  # the common case, without stack()'s batch of every field
        rf = images[0]
        arrays = {"region_features": rf.features.astype(np.float32), "region_boxes": rf.normalized_boxes(),
                  "region_mask": rf.region_mask()}
        if rf.image_feature is not None:
            arrays["image_feature"] = rf.image_feature.astype(np.float32)
        if tag_words is not None:
            arrays["tag_ids"] = region_tag_ids(rf.obj_ids, tag_words)
        return arrays
    batch = stack(images)
    arrays = {
        "region_features": batch["features"].astype(np.float32),  # (k, N, D)
        "region_boxes": batch["norm_boxes"],  # (k, N, 4) in [0, 1]
        "region_mask": batch["region_mask"],  # (k, N)
    }
    if "image_feature" in batch:
        arrays["image_feature"] = batch["image_feature"].astype(np.float32)  # (k, D)
    if tag_words is not None:
        arrays["tag_ids"] = region_tag_ids(batch["obj_ids"], tag_words)  # (k, N)
    return arrays


class Pipeline:
    """Runs the four tasks for the routes; raises InvalidInput / NoHeadError / UnknownImageError / ImageError /
    QueueFullError, which the app turns into problem+json answers."""

    def __init__(self, regions: RegionService, tokenizer: VLTokenizer, specs: dict[str, TaskSpec],
                 batchers: dict[str, Batcher], limits: Limits, streams: StreamCache | None = None,
                 tag_words: np.ndarray | None = None, bank: BankPriors | None = None, bank_on_register: bool = True,
                 explainer: Explainer | None = None, detector_labels: tuple[Sequence[str], Sequence[str]] = ((), ())):
        self.regions = regions
        self.detector_labels = detector_labels  # (class names, attribute names) of the detector's ids
        self.explainer = explainer  # explain=true; None where the runtime does not return attention
        self.bank = bank  # the model's query bank: text -> image ranks bank-normalised scores
        self.bank_on_register = bank_on_register  # POST /images schedules the image's prior (in the background)
        self.tag_words = tag_words  # detector class id -> word id, for an encoder fine-tuned with region tags
        self.tokenizer = tokenizer
        self.specs = specs  # kind -> spec
        self.batchers = batchers  # task name -> batcher
        self.limits = limits
        self.streams = streams  # set when the itm batcher runs fused_batch_fn: retrieval submits Pair items

    # ---- inputs ----

    @property
    def endpoints(self) -> list[str]:
        """The task endpoints this model answers (a kind without a spec answers 404 no-head), in SERVED_KINDS order."""
        return [ENDPOINT_OF[kind] for kind in SERVED_KINDS if kind in self.specs]

    def spec(self, kind: str) -> TaskSpec:
        spec = self.specs.get(kind)
        if spec is None:
            endpoint = ENDPOINT_OF.get(kind, kind)
            raise NoHeadError(f"this model has no {kind} head, so it does not serve {endpoint}; "
                              f"it serves: {', '.join(self.endpoints) or 'nothing'}")
        return spec

    def check_top_k(self, top_k: int) -> None:
        if not 1 <= top_k <= self.limits.max_top_k:
            raise InvalidInput(("top_k",), f"must be between 1 and {self.limits.max_top_k}, got {shown(str(top_k))}",
                               self.limits.max_top_k)

    def check_candidates(self, loc: str, count: int) -> None:
        if count > self.limits.max_candidates:
            raise InvalidInput((loc,), f"at most {self.limits.max_candidates} candidates per request, got {count}",
                               self.limits.max_candidates)

    def text(self, text: str, loc: tuple[str | int, ...], answer_slot: bool | str = False) -> Item:
        """Token arrays of one text row, refusing empty, too long (characters) or too many word pieces."""
        if not text.strip():
            raise InvalidInput(loc, "must not be empty or only whitespace")
        if len(text) > self.limits.max_text_chars:
            raise InvalidInput(loc, f"is {len(text)} characters long; the limit is {self.limits.max_text_chars}",
                               self.limits.max_text_chars)
        specials = self.tokenizer.special_count(answer_slot)  # [CLS] text ([MASK]) [SEP], or VL-BERT's [SEP] [MASK] [SEP]
        # one tokenization: a text over the limit comes back cut to limit + 1, which is enough to refuse it
        encoded = self.tokenizer.encode([text], answer_slot=answer_slot, max_length=self.limits.max_text_tokens + 1)
        length = encoded["input_ids"].shape[1]
        if length == specials:  # e.g. only control characters, which the normalizer drops
            raise InvalidInput(loc, "has no words the tokenizer can read")
        tok = self.tokenizer
        if set(encoded["input_ids"][0].tolist()) <= {tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id}:
            # e.g. only emoji: the model would read no word and answer as if asked nothing
            raise InvalidInput(loc, "has no words in the model's vocabulary (every word piece is [UNK])")
        if length > self.limits.max_text_tokens:
            length = len(self.tokenizer.token_ids(text)) + specials  # the real length, for the message
            raise InvalidInput(loc, f"is {length} word pieces long; the limit is {self.limits.max_text_tokens}",
                               self.limits.max_text_tokens)
        return {name: value[0] for name, value in encoded.items()}

    async def image(self, data: bytes | None, image_id: str | None, timer: Timer,
                    register: bool = False) -> tuple[str, RegionFeatures]:
        """(image_id, regions) of an inline image or of one registered earlier; register (POST /images): the shared
        store must hold the image afterwards (RegionService.from_bytes)."""
        return (await self.images([(data, image_id)], timer, register))[0]

    async def images(self, refs: Sequence[tuple[bytes | None, str | None]], timer: Timer,
                     register: bool = False) -> list[tuple[str, RegionFeatures]]:
        """(image_id, regions) of each image, looked up and detected together: a request's new images are admitted
        by the detector one after the other at once (not one after the other's detection) and may share its batch;
        its ids are looked up in one batch (RegionService.from_ids). The first failing image, in request order,
        fails the request."""
        with timer.stage("regions"):
            if len(refs) == 1:
                try:
                    found = [await self._regions(*refs[0], register)]
                except ImageError as exc:  # the request field it came in (the 422 names it)
                    raise located(exc, "image") from None
            else:
                inline = [i for i, (data, _) in enumerate(refs) if data is not None]
                ids = [image_id for data, image_id in refs if data is None]
                looked_up, *computed = await asyncio.gather(
                    self.regions.from_ids(ids), *(self._regions(refs[i][0], None, register) for i in inline),
                    return_exceptions=True)
                failures = {i: c for i, c in zip(inline, computed) if isinstance(c, BaseException)}
                if isinstance(looked_up, BaseException):  # an unknown id names itself; the store down fails every id
                    unknown = getattr(looked_up, "image_id", None)
                    failures[next(i for i, (data, image_id) in enumerate(refs)
                                  if data is None and unknown in (None, image_id))] = looked_up
                if failures:
                    index = min(failures)
                    if isinstance(failures[index], ImageError):
                        raise located(failures[index], "images", index, "image") from None
                    raise failures[index]
                by_id, by_index = iter(looked_up), dict(zip(inline, computed))
                found = [by_index[i] if data is not None else (image_id, next(by_id), True)
                         for i, (data, image_id) in enumerate(refs)]
        for _, _, hit in found:
            timer.hit(hit)
        return [(image_id, rf) for image_id, rf, _ in found]

    async def _regions(self, data: bytes | None, image_id: str | None,
                       register: bool = False) -> tuple[str, RegionFeatures, bool]:
        if data is not None:
            return await self.regions.from_bytes(data, register)
        return image_id, await self.regions.from_id(image_id), True

    async def run(self, spec: TaskSpec, items: list[Item] | list[Pair], timer: Timer,
                  background: bool = False, bulk: bool = False) -> list[np.ndarray]:
        """Logits of each item from the task's batcher (items of one request may share a batch); background items
        run only when no request waits, bulk items (an admitted request's long work) behind requests, in turn with
        them, and neither is refused (batcher module doc)."""
        submitted = time.perf_counter()
        batcher = self.batchers[spec.task]
        if len(items) == 1:  # no task per item for the common single-item request
            results: list[Scored] = [await batcher.submit(items[0], background, bulk=bulk)]
        else:  # the request is admitted or refused whole: its own items are no queue to shed it by
            if not (background or bulk):
                batcher.admit()
            outcomes = await asyncio.gather(*(batcher.submit(item, background, admitted=True, bulk=bulk)
                                              for item in items), return_exceptions=True)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                raise failed[0]
            results = outcomes
        timer.add("queue", min(r.started for r in results) - submitted)
        batches = {(r.started, r.ended) for r in results}
        timer.add("encoder", sum(end - start for start, end in batches))
        return [r.logits for r in results]

    async def explained(self, spec: TaskSpec, item: Item, text: str, images: Sequence[tuple[str, RegionFeatures]],
                        timer: Timer) -> tuple[np.ndarray, list[dict[str, Any]]]:
        """explain=true: the item's logits from a pass of its own that keeps the attention (outside the batcher),
        and the response's `explain` entries, one per image."""
        if self.explainer is None:
            raise InvalidInput(("query", "explain"), "this service's runtime does not return attention; explain needs the "
                                             "torch runtime, serving a checkpoint directory")
        logits, attention, seconds = await self.explainer.run(spec.task, item)
        timer.add("encoder", seconds)
        return logits, explain_pairs(self.explainer, attention, text, item, images)

    async def answer(self, spec: TaskSpec, item: Item, timer: Timer, explain: bool, text: str,
                     images: Sequence[tuple[str, RegionFeatures]]) -> tuple[np.ndarray, dict[str, Any]]:
        """The item's logits from the task's batcher, or with explain from an explained pass (and {"explain": ...})."""
        if not explain:
            (logits,) = await self.run(spec, [item], timer)
            return logits, {}
        logits, entries = await self.explained(spec, item, text, images, timer)
        return logits, {"explain": entries}

    def tokens(self, text: str, loc: tuple[str | int, ...], timer: Timer, answer_slot: bool | str = False) -> Item:
        with timer.stage("tokenize"):
            return self.text(text, loc, answer_slot)

    # ---- tasks ----

    async def vqa(self, data: bytes | None, image_id: str | None, question: str, top_k: int, timer: Timer,
                  explain: bool = False) -> dict[str, Any]:
        spec = self.spec("vqa")
        self.check_top_k(top_k)
        text = self.tokens(question, ("question",), timer, spec.answer_slot)
        image_id, rf = await self.image(data, image_id, timer)
        item = {**text, **region_arrays([rf], self.tag_words)}
        logits, explained = await self.answer(spec, item, timer, explain, question, [(image_id, rf)])
        names = spec.labels or tuple(f"answer_{i}" for i in range(logits.shape[-1]))
        answers = top_answers(logits, names, top_k, spec.score)
        return {"image_id": image_id, "answers": [{"answer": a, "score": s} for a, s in answers], **explained}

    async def refer(self, data: bytes | None, image_id: str | None, expression: str, timer: Timer,
                    explain: bool = False) -> dict[str, Any]:
        spec = self.spec("refer")
        text = self.tokens(expression, ("expression",), timer)
        image_id, rf = await self.image(data, image_id, timer)
        if rf.num_boxes == 0:
            raise InvalidInput(("image",), "the detector found no regions in this image")
        item = {**text, **region_arrays([rf], self.tag_words)}
        logits, explained = await self.answer(spec, item, timer, explain, expression, [(image_id, rf)])
        regions = [{"index": i, "box": [float(v) for v in rf.boxes[i]], "score": s}
                   for i, s in ranked_regions(logits, rf.num_boxes, 1 + RUNNER_UP)]
        best = regions[0]
        return {"image_id": image_id, "box": best["box"], "score": best["score"], "region": best,
                "runner_up": regions[1:], "image_size": list(rf.image_hw), **explained}

    async def text_to_images(self, text: str, image_ids: list[str], top_k: int, timer: Timer,
                             query_bank: bool = True, explain: bool = False) -> dict[str, Any]:
        """Ranks the images by the bank-normalised score where the model has a query bank (and query_bank), else
        by the raw score; explain: the text over the best image."""
        spec = self.spec("itm")
        self.check_top_k(top_k)
        self.check_candidates("image_ids", len(image_ids))
        tokens = self.tokens(text, ("text",), timer)
        images = await self.images([(None, i) for i in image_ids], timer)
        score, prob = match_scores(np.stack(await self.run(spec, self.pairs(tokens, images), timer)))
        hits = [{"image_id": image_ids[i], "score": float(score[i]), "probability": float(prob[i])} for i in range(len(images))]
        key = score
        if self.bank is not None and query_bank:
            t0 = time.perf_counter()
            key = self.bank.normalise(score, await self.bank.priors(images, functools.partial(self.score_rows, spec)))
            timer.add("query_bank", time.perf_counter() - t0)
            for hit, value in zip(hits, key):
                hit["bank_score"] = float(value)
        order = rank(key, top_k)
        explained = {}
        if explain:
            item = {**tokens, **region_arrays([images[order[0]][1]], self.tag_words)}
            explained["explain"] = (await self.explained(spec, item, text, [images[order[0]]], timer))[1]
        return {"direction": "text_to_images", "results": [hits[i] for i in order], **explained}

    async def score_rows(self, spec: TaskSpec, rows: Sequence[Item], image_id: str, rf: RegionFeatures,
                         background: bool = False) -> np.ndarray:
        """Match scores of text rows (a query bank's) with one image, a batch at a time so the queue never fills;
        their queue and encoder time are not the request's (it counts them as its query_bank stage). For a request
        they are bulk work (behind other requests, in turn with them, never refused: the request was admitted); in
        the background (a registered image's prior) they run only when no request waits."""
        if self.streams is None:  # the image's arrays once for every row
            regions = region_arrays([rf], self.tag_words)
            pairs = [{**row, **regions} for row in rows]
        else:
            pairs = [self.pairs(row, [(image_id, rf)])[0] for row in rows]
        chunk = self.batchers[spec.task].config.max_batch_size
        logits = [lg for s in range(0, len(pairs), chunk)
                  for lg in await self.run(spec, pairs[s:s + chunk], Timer(), background, bulk=not background)]
        return match_scores(np.stack(logits))[0]

    def pairs(self, tokens: Item, images: Sequence[tuple[str, RegionFeatures]]) -> list[Item] | list[Pair]:
        """The retrieval head's items of one text row with each image."""
        if self.streams is None:
            return [{**tokens, **region_arrays([rf], self.tag_words)} for _, rf in images]
        text_key = self.streams.text_key(tokens)
        return [self.streams.pair(text_key, tokens, image_id, rf) for image_id, rf in images]

    async def image_to_texts(self, data: bytes | None, image_id: str | None, texts: list[str], top_k: int,
                             timer: Timer, explain: bool = False) -> dict[str, Any]:
        """Ranks the texts for the image; explain: the best text over the image."""
        spec = self.spec("itm")
        self.check_top_k(top_k)
        self.check_candidates("texts", len(texts))
        rows = [self.tokens(t, ("texts", i), timer) for i, t in enumerate(texts)]
        # texts that read as the same word pieces are scored once: equal scores, so their tie keeps the request's
        # order (scored in separate batches they differed by float rounding and could swap)
        first: dict[tuple[bytes, ...], int] = {}  # word pieces -> index in distinct
        distinct, slot = [], []  # slot[i]: texts[i]'s row in distinct
        for row in rows:
            key = tuple(row[name].tobytes() for name in sorted(row))
            if key not in first:
                first[key] = len(distinct)
                distinct.append(row)
            slot.append(first[key])
        image_id, rf = await self.image(data, image_id, timer)
        if self.streams is None:
            regions = region_arrays([rf], self.tag_words)
            items = [{**row, **regions} for row in distinct]
        else:
            items = [self.streams.pair(self.streams.text_key(row), row, image_id, rf) for row in distinct]
        logits = await self.run(spec, items, timer)
        score, prob = match_scores(np.stack(logits)[slot])
        hits = [{"index": i, "text": texts[i], "score": float(score[i]), "probability": float(prob[i])}
                for i in rank(score, top_k)]
        explained = {}
        if explain:
            best = hits[0]["index"]
            item = {**rows[best], **region_arrays([rf], self.tag_words)}
            explained["explain"] = (await self.explained(spec, item, texts[best], [(image_id, rf)], timer))[1]
        return {"direction": "image_to_texts", "image_id": image_id, "results": hits, **explained}

    async def nlvr2(self, refs: Sequence[tuple[bytes | None, str | None]], statement: str, timer: Timer,
                    explain: bool = False) -> dict[str, Any]:
        spec = self.spec("nlvr2")
        text = self.tokens(statement, ("statement",), timer)
        pair = await self.images(refs, timer)
        item = {**text, **region_arrays([rf for _, rf in pair], self.tag_words)}
        logits, explained = await self.answer(spec, item, timer, explain, statement, pair)
        p_true = true_probability(logits)
        return {"image_ids": [i for i, _ in pair], "answer": p_true >= 0.5, "probability": p_true, **explained}

    async def register(self, data: bytes, timer: Timer, with_regions: bool = False) -> dict[str, Any]:
        """The image's id and size; with_regions: its regions too (boxes, class and attribute with their scores)."""
        image_id, rf = await self.image(data, None, timer, register=True)
        if self.bank is not None and self.bank_on_register:
            self.bank.schedule(image_id, rf, functools.partial(self.score_rows, self.spec("itm"),
                                                               background=True))
        found = {"regions": detected_regions(rf, *self.detector_labels)} if with_regions else {}
        return {"image_id": image_id, "num_boxes": rf.num_boxes, "image_size": list(rf.image_hw),
                "cached": bool(timer.cache_hit), **found}

    # ---- start-up ----

    def warm_up(self, runtime: Runtime, rf: RegionFeatures) -> None:
        """One tiny example per served task straight through the runtime (first-call allocations, lazy init)."""
        for spec in self.specs.values():
            encoded = self.tokenizer.encode(["warm up"], answer_slot=spec.answer_slot, max_length=8)  # no request limits
            text = {name: value[0] for name, value in encoded.items()}
            regions = region_arrays([rf, rf] if spec.kind == "nlvr2" else [rf], self.tag_words)
            batch_fn(runtime, spec.task)([{**text, **regions}])
            if self.streams is not None and runtime.splits_streams(spec.task):  # /retrieve's path: streams apart
                scratch = StreamCache(1 << 24, "warm-up", "warm-up")  # not the served cache: nothing of this stays
                fused_batch_fn(runtime, spec.task, scratch)([scratch.pair(scratch.text_key(text), text, "warm-up", rf)])
