"""Task examples over a RegionTable (VQA, refer, image-text matching, NLVR2, multiple choice, retrieval) and their
collation into VLInputs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from models import HeadConfig, VLInputs
from models.config import ANSWER_POOLS
from models.spatial import pairwise_iou
from models.tokenizer import VLTokenizer

from .easy_vqa import EasyVQASplit
from .region_table import RegionTable
from .shapes_cache import ShapesSplit
from .shapes_tasks import false_listings
from .shapes_world import Scene


@dataclass(frozen=True)
class Example:
    rows: tuple[int, ...]  # RegionTable row(s): one image, or (left, right) for NLVR2
    text: str  # question, expression, caption or statement
    label: object  # vqa: answer index; refer: gold pixel box; itm / nlvr2: 0 or 1; multiple choice: index of
    # the correct choice; retrieval: the image's objects_key
    choices: tuple[str, ...] = ()  # multiple choice: the candidate answers


def shapes_examples(split: ShapesSplit, answers: list[str], seed: int = 0, row_offset: int = 0) -> dict[str, list[Example]]:
    """Every shapes-world annotation of a split as examples; ITM pairs captions with their image (1), with
    their hard negatives (0), and with a random other image (0). Rows are scene index + row_offset."""
    rng = np.random.default_rng(seed)
    index = {a: i for i, a in enumerate(answers)}
    row_of = {ann["id"]: i + row_offset for i, ann in enumerate(split.annotations)}
    out: dict[str, list[Example]] = {"vqa": [], "refer": [], "itm": [], "nlvr2": [], "multiple_choice": []}
    n = len(split.annotations)
    for i, ann in enumerate(split.annotations):
        row = i + row_offset
        out["vqa"] += [Example((row,), q["question"], index[q["answer"]]) for q in ann["vqa"]]
        out["refer"] += [Example((row,), r["expression"], tuple(r["box"])) for r in ann["refer"]]
        for caption in ann["captions"]:
            out["itm"].append(Example((row,), caption, 1))
            other = int(rng.integers(0, n - 1)) if n > 1 else i
            other += other >= i  # any image but this one
            if n > 1:
                out["itm"].append(Example((other + row_offset,), caption, 0))
        out["itm"] += [Example((row,), neg["caption"], 0) for neg in ann["negatives"]]
        out["multiple_choice"] += [Example((row,), q["question"], q["answer"], tuple(q["choices"])) for q in ann["mc"]]
    out["nlvr2"] = [Example((row_of[p["left"]], row_of[p["right"]]), p["statement"], int(p["label"])) for p in split.nlvr2]
    return out


def question_examples(split: ShapesSplit, answers: list[str], questions: Callable[[Scene], list[dict]],
                      row_offset: int = 0) -> list[Example]:
    """Every question `questions` asks of each scene of a split (e.g. shapes_tasks.position_questions), as VQA examples."""
    index = {a: i for i, a in enumerate(answers)}
    return [Example((i + row_offset,), q["question"], index[q["answer"]])
            for i in range(len(split.annotations)) for q in questions(split.scene(i))]


def expression_examples(split: ShapesSplit, expressions: Callable[[Scene], list[dict]], row_offset: int = 0) -> list[Example]:
    """Every referring expression `expressions` gives of each scene of a split (e.g. shapes_tasks.related_expressions),
    as refer examples."""
    return [Example((i + row_offset,), r["expression"], tuple(r["box"]))
            for i in range(len(split.annotations)) for r in expressions(split.scene(i))]


def retrieval_examples(split: ShapesSplit, row_offset: int = 0) -> list[Example]:
    """One gold caption per scene for retrieval: the listing of every object, left to right (captions[0]).

    It is the only caption kind that pins down every object. Its label is the scene's multiset of objects:
    the caption is true of exactly the images with the same label.
    """
    return [Example((i + row_offset,), ann["captions"][0], objects_key(ann)) for i, ann in enumerate(split.annotations)]


RANK_GROUP, RANK_HARD, RANK_NEIGHBOURS = 8, 5, 20  # ranking groups: size, close scenes drawn, from how many


def ranking_examples(split: ShapesSplit, group_size: int = RANK_GROUP, hard: int = RANK_HARD,
                     neighbours: int = RANK_NEIGHBOURS, seed: int = 0, row_offset: int = 0,
                     by_objects: bool = False, partial: int = 0) -> list[Example]:
    """Retrieval training groups: each scene's listing caption (captions[0]) with its own image first, then
    `hard` scenes drawn from the `neighbours` whose objects overlap its own most, then `partial` scenes whose every
    object the listing names but that lack some of its objects (a part of the scene: where there are none, random
    ones), then random scenes; never a scene the caption is true of (the same objects_key). Rows are scene index +
    row_offset. With by_objects, a scene of n objects gives n groups, each with negatives of its own: long listings
    are drawn n times as often. The closest scenes share most objects and about as many: without `partial`, an image
    of one or two of a long listing's objects is a negative only by chance."""
    keys = [objects_key(ann) for ann in split.annotations]
    n = len(keys)
    if n < group_size:
        return []
    vocab = {o: k for k, o in enumerate(sorted({o for key in keys for o in key}))}
    counts = np.zeros((n, len(vocab)), dtype=np.int16)  # objects of each kind per scene
    for i, key in enumerate(keys):
        for o in key:
            counts[i, vocab[o]] += 1
    ids: dict[tuple, int] = {}
    key_id = np.array([ids.setdefault(k, len(ids)) for k in keys])
    sizes = counts.sum(1)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        others = np.flatnonzero(key_id != key_id[i])  # scenes the caption is false of
        if len(others) < group_size - 1:
            continue
        overlap = np.minimum(counts[i], counts[others]).sum(1) - np.abs(sizes[others] - sizes[i])  # shared objects minus size gap
        near = min(neighbours, len(others))
        close = others[np.argpartition(-overlap, near - 1)[:near]]
        parts = others[(counts[others] <= counts[i]).all(1)] if partial else others[:0]  # strict sub-multisets
        for _ in range(int(sizes[i]) if by_objects else 1):
            picked = [int(j) for j in rng.permutation(close)[:hard]]
            if partial:
                fresh = [int(j) for j in rng.permutation(parts) if j not in picked]
                picked += fresh[:min(partial, group_size - 1 - len(picked))]
            while len(picked) < group_size - 1:
                j = int(others[rng.integers(len(others))])
                if j not in picked:
                    picked.append(j)
            out.append(Example(tuple(r + row_offset for r in (i, *picked)), split.annotations[i]["captions"][0], 0))
    return out


def caption_ranking_examples(split: ShapesSplit, group_size: int = RANK_GROUP, seed: int = 0,
                             row_offset: int = 0) -> list[Example]:
    """Retrieval training groups seen from the image: each scene with its listing caption (text, the first
    candidate) and, as choices, group_size - 1 false listings one step from it (an attribute changed, an object
    left out or added). Label 0: the true caption. Scenes with too few near misses are skipped."""
    rng = np.random.default_rng(seed)
    out = []
    for i, ann in enumerate(split.annotations):
        false = false_listings(split.scene(i), rng, group_size - 1)
        if len(false) == group_size - 1:
            out.append(Example((i + row_offset,), ann["captions"][0], 0, tuple(false)))
    return out


def objects_key(annotation: dict) -> tuple[tuple[str, str, str], ...]:
    """The scene's objects as a sorted tuple of (size, color, shape): equal keys, same listing truth."""
    return tuple(sorted((o["size"], o["color"], o["shape"]) for o in annotation["objects"]))


def easy_vqa_images(split: EasyVQASplit) -> list[int]:
    """The split's image ids in RegionTable row order."""
    return sorted(split.image_paths)


def easy_vqa_examples(split: EasyVQASplit, answers: list[str], row_offset: int = 0) -> list[Example]:
    """easy-VQA questions as VQA examples over our answer vocabulary (which contains all 13 of its answers)."""
    index = {a: i for i, a in enumerate(answers)}
    missing = sorted(set(split.answers) - set(index))
    if missing:
        raise ValueError(f"answer vocabulary lacks easy-VQA answers: {', '.join(missing)}")
    row_of = {image_id: row + row_offset for row, image_id in enumerate(easy_vqa_images(split))}
    return [Example((row_of[e.image_id],), e.question, index[e.answer]) for e in split.examples]


def refer_targets(table: RegionTable, rows: np.ndarray, gold: np.ndarray, thresh: float = 0.5,
                  width: int | None = None) -> torch.Tensor:
    """(B, width or N) 1 where a real region overlaps the gold box with IoU >= thresh (the refer head's targets)."""
    n = width or table.mask.shape[1]
    targets = torch.zeros(len(rows), n)
    for b, (row, box) in enumerate(zip(rows, gold)):
        iou = pairwise_iou(torch.from_numpy(table.pixel_boxes[row, :n]), torch.from_numpy(np.asarray(box, dtype=np.float32)[None]))[:, 0]
        targets[b] = (iou >= thresh).float() * torch.from_numpy(table.mask[row, :n]).float()
    return targets


def collate(
    kind: str,
    examples: list[Example],
    table: RegionTable,
    tokenizer: VLTokenizer,
    head: HeadConfig,
    max_length: int = 40,
    with_labels: bool = True,
) -> tuple[VLInputs, torch.Tensor | None]:
    """One padded batch of a task (head kind) and its labels in the head's format (None without `with_labels`: an
    evaluation scores the logits itself, and a VQA head may know fewer answers than the data's ids reach)."""
    if kind in ("itm_rank", "itm_rank_text"):  # groups, flattened: a caption with each of its images (itm_rank) or
        # an image with each of its captions (itm_rank_text); label = the true pair's place in its group
        flat = ([Example((row,), e.text, 0) for e in examples for row in e.rows] if kind == "itm_rank" else
                [Example(e.rows, text, 0) for e in examples for text in (e.text, *e.choices)])
        inputs, _ = collate("itm", flat, table, tokenizer, head, max_length, with_labels=False)
        return inputs, torch.tensor([e.label for e in examples], dtype=torch.long) if with_labels else None
    if kind == "multiple_choice":
        text = encode_choices(tokenizer, examples, max_length)
    else:
        slot = head.pool if head.pool in ANSWER_POOLS else False
        text = tokenizer.encode([e.text for e in examples], answer_slot=slot, max_length=max_length)
    rows = np.array([e.rows if kind == "nlvr2" else e.rows[0] for e in examples])
    width = table.width(rows)  # the batch's region slots: padding no image of it needs is dropped
    inputs = VLInputs(
        input_ids=torch.from_numpy(text["input_ids"]),
        attention_mask=torch.from_numpy(text["attention_mask"]),
        token_type_ids=torch.from_numpy(text["token_type_ids"]),
        **table.tensors(rows, width),  # NLVR2 rows (B, 2) give (B, 2, width, ...) region tensors
    )
    if not with_labels:
        return inputs, None
    if kind in ("vqa", "image_qa"):
        labels = torch.zeros(len(examples), head.num_labels)
        labels[torch.arange(len(examples)), torch.tensor([e.label for e in examples])] = 1.0
    elif kind == "refer":
        labels = refer_targets(table, rows, np.array([e.label for e in examples], dtype=np.float32), width=width)
    elif kind in ("itm", "nlvr2", "multiple_choice"):
        labels = torch.tensor([e.label for e in examples], dtype=torch.long)
    else:
        raise ValueError(f"collate does not know task kind {kind!r}")
    return inputs, labels


def encode_choices(tokenizer: VLTokenizer, examples: list[Example], max_length: int) -> dict[str, np.ndarray]:
    """`[CLS] question [SEP] choice [SEP]` per candidate, as (B, C, T) arrays (the multiple-choice head's layout).

    A question with fewer candidates than the batch's most is padded with copies of one of its wrong ones:
    the same text scores the same, so the copy never changes which candidate wins.
    """
    if any(not e.choices for e in examples):
        raise ValueError("multiple choice needs examples with choices")
    width = max(len(e.choices) for e in examples)
    wrong = [next((c for i, c in enumerate(e.choices) if i != e.label), e.choices[0]) for e in examples]
    choices = [[*e.choices, *[w] * (width - len(e.choices))] for e, w in zip(examples, wrong)]
    flat = tokenizer.encode([e.text for e in examples for _ in range(width)], pairs=[c for row in choices for c in row],
                            max_length=max_length)
    return {k: v.reshape(len(examples), width, -1) for k, v in flat.items()}
