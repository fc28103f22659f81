"""Readers for the annotation formats users bring: VQA v2, RefCOCO+ (JSON refs), Flickr30K captions, NLVR2.

Every reader returns plain dataclasses and raises ValueError naming the file (and line) on malformed input.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PathLike = str | os.PathLike


def _load_json(path: PathLike):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None


# --- VQA v2: answer normalisation and soft scores ---

# Compact version of the official VQA evaluation's normalisation (vqaEval.py): same steps, smaller tables.
_NUMBER_WORDS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
                 "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = {"a", "an", "the"}
_CONTRACTIONS = {w.replace("'", ""): w for w in (
    "aren't", "can't", "couldn't", "didn't", "doesn't", "don't", "hadn't", "hasn't", "haven't", "isn't",
    "it's", "let's", "shouldn't", "that's", "there's", "wasn't", "weren't", "what's", "won't", "wouldn't",
    "you're", "they're", "we're", "who's", "where's")}
_PUNCTUATION = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!")
_DIGIT_COMMA_DIGIT = re.compile(r"\d,\d")
_PERIOD_NOT_DECIMAL = re.compile(r"\.(?!\d)")


def normalize_answer(answer: str) -> str:
    """VQA eval normalisation: lowercase; punctuation removed (next to a space, or anywhere when the text
    has a number like 1,000) or else turned into a space; periods dropped unless before a digit; number
    words to digits; articles dropped; common contractions restored ("dont" -> "don't")."""
    text = answer.replace("\n", " ").replace("\t", " ").strip().lower()
    remove_all = _DIGIT_COMMA_DIGIT.search(text) is not None
    for p in _PUNCTUATION:
        joined = remove_all or f"{p} " in text or f" {p}" in text
        text = text.replace(p, "" if joined else " ")
    text = _PERIOD_NOT_DECIMAL.sub("", text)
    words = (_NUMBER_WORDS.get(w, w) for w in text.split())
    return " ".join(_CONTRACTIONS.get(w, w) for w in words if w not in _ARTICLES)


def vqa_accuracy(candidate: str, human_answers: Sequence[str]) -> float:
    """Official VQA accuracy of one (normalized) answer: the mean over the leave-one-out subsets of the
    human answers (10 subsets of 9 for VQA v2) of min(1, matches / 3)."""
    n = len(human_answers)
    if n == 0:
        return 0.0
    if n == 1:
        return min(1.0, float(human_answers[0] == candidate) / 3)
    matches = sum(a == candidate for a in human_answers)
    # Leaving out a matching answer (matches subsets) leaves matches-1; any other leaves matches.
    total = matches * min(1.0, (matches - 1) / 3) + (n - matches) * min(1.0, matches / 3)
    return total / n


def vqa_soft_scores(human_answers: Sequence[str]) -> dict[str, float]:
    """Soft target of every distinct (normalized) human answer: its official VQA accuracy.

    With 10 answers, an answer given by 1, 2, 3, >=4 humans scores 0.3, 0.6, 0.9, 1.0 (the simpler
    min(1, count/3) would give 1/3, 2/3, 1, 1).
    """
    return {answer: vqa_accuracy(answer, human_answers) for answer in dict.fromkeys(human_answers)}


@dataclass
class VQAQuestion:
    question_id: int
    image_id: int
    question: str
    answers: list[str] = field(default_factory=list)  # the human answers, normalized (empty for test splits)
    scores: dict[str, float] = field(default_factory=dict)  # normalized answer -> soft score
    multiple_choice_answer: str | None = None  # the annotators' most common answer, normalized
    question_type: str | None = None  # e.g. "what color is the"
    answer_type: str | None = None  # "yes/no", "number" or "other"


def read_vqa(questions_path: PathLike, annotations_path: PathLike | None = None) -> list[VQAQuestion]:
    """VQA v2 `v2_OpenEnded_mscoco_*_questions.json` (+ `v2_mscoco_*_annotations.json` when labelled)."""
    questions = _load_json(questions_path)
    try:
        items = [VQAQuestion(int(q["question_id"]), int(q["image_id"]), str(q["question"]))
                 for q in questions["questions"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{questions_path}: not a VQA questions file: missing or bad {e}") from None
    if annotations_path is None:
        return items
    by_id = {q.question_id: q for q in items}
    annotations = _load_json(annotations_path)
    try:
        for ann in annotations["annotations"]:
            q = by_id[int(ann["question_id"])]
            if int(ann["image_id"]) != q.image_id:
                raise ValueError(f"question {q.question_id}: image_id differs from the questions file")
            q.answers = [normalize_answer(a["answer"]) for a in ann["answers"]]
            q.scores = vqa_soft_scores(q.answers)
            mc = ann.get("multiple_choice_answer")
            q.multiple_choice_answer = None if mc is None else normalize_answer(mc)
            q.question_type, q.answer_type = ann.get("question_type"), ann.get("answer_type")
    except (KeyError, TypeError) as e:
        raise ValueError(f"{annotations_path}: not a VQA annotations file: missing or bad {e}") from None
    except ValueError as e:
        raise ValueError(f"{annotations_path}: {e}") from None
    return items


# --- RefCOCO / RefCOCO+ / RefCOCOg (JSON form of refs(unc).p, plus COCO instances.json) ---

Box = tuple[float, float, float, float]  # pixel x1, y1, x2, y2


def xywh_to_xyxy(bbox: Sequence[float]) -> Box:
    """COCO [x, y, width, height] -> (x1, y1, x2, y2)."""
    x, y, w, h = (float(v) for v in bbox)
    return (x, y, x + w, y + h)


@dataclass
class CocoImage:
    image_id: int
    file_name: str
    height: int
    width: int
    boxes: dict[int, Box] = field(default_factory=dict)  # annotation id -> box, every object in the image


@dataclass
class RefExpression:
    """One referring sentence with its target box (one per sentence of a ref)."""
    ref_id: int
    sent_id: int | None
    image_id: int
    ann_id: int
    split: str  # train / val / testA / testB (refcoco, refcoco+), test (refcocog umd)
    sentence: str
    box: Box
    category_id: int | None = None


@dataclass
class RefDataset:
    expressions: list[RefExpression]
    images: dict[int, CocoImage]  # image_id -> image with all its candidate boxes


def read_coco_instances(instances_path: PathLike) -> dict[int, CocoImage]:
    """COCO-style `instances.json`: images and annotations (bbox [x,y,w,h]) -> image_id -> CocoImage."""
    data = _load_json(instances_path)
    try:
        images = {int(im["id"]): CocoImage(int(im["id"]), str(im["file_name"]), int(im["height"]), int(im["width"]))
                  for im in data["images"]}
        for ann in data["annotations"]:
            images[int(ann["image_id"])].boxes[int(ann["id"])] = xywh_to_xyxy(ann["bbox"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{instances_path}: not a COCO instances file: missing or bad {e}") from None
    return images


def read_refcoco(refs_path: PathLike, instances_path: PathLike, split: str | None = None) -> RefDataset:
    """Refs as JSON (a list of {ref_id, image_id, ann_id, split, sentences: [{sent, sent_id}]}, or
    {"refs": [...]}) — the pickled `refs(unc).p` is not read: unpickling runs arbitrary code."""
    refs = _load_json(refs_path)
    if isinstance(refs, dict):
        refs = refs.get("refs")
    if not isinstance(refs, list):
        raise ValueError(f"{refs_path}: expected a JSON list of refs")
    images = read_coco_instances(instances_path)
    boxes = {ann_id: box for im in images.values() for ann_id, box in im.boxes.items()}
    expressions = []
    try:
        for ref in refs:
            if split is not None and ref["split"] != split:
                continue
            ann_id = int(ref["ann_id"])
            if ann_id not in boxes:
                raise ValueError(f"ref {ref['ref_id']}: ann_id {ann_id} is not in {instances_path}")
            for sent in ref["sentences"]:
                expressions.append(RefExpression(
                    ref_id=int(ref["ref_id"]), sent_id=sent.get("sent_id"), image_id=int(ref["image_id"]),
                    ann_id=ann_id, split=str(ref["split"]), sentence=str(sent["sent"]), box=boxes[ann_id],
                    category_id=ref.get("category_id")))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{refs_path}: not a refs file: missing or bad {e}") from None
    return RefDataset(expressions, images)


# --- Flickr30K captions ---

@dataclass
class Caption:
    image_file: str  # e.g. "1000092795.jpg"
    index: int  # caption number within the image (token file) or sentid (Karpathy)
    caption: str
    split: str | None = None  # Karpathy split: train / val / test (None for the token file)


def read_flickr30k_tokens(path: PathLike) -> list[Caption]:
    """`results_20130124.token`: lines "1000092795.jpg#0<TAB>Two young guys ...", five per image."""
    captions = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            key, tab, caption = line.partition("\t")
            image_file, hash_, index = key.rpartition("#")
            if not tab or not hash_ or not index.isdigit() or not image_file:
                raise ValueError(f"{path} line {line_no}: expected 'image.jpg#i<TAB>caption', got {line[:80]!r}")
            captions.append(Caption(image_file, int(index), caption.strip()))
    return captions


def read_flickr30k_karpathy(path: PathLike, split: str | None = None) -> list[Caption]:
    """Karpathy's `dataset_flickr30k.json`: {"images": [{filename, split, sentences: [{raw, sentid}]}]}."""
    data = _load_json(path)
    try:
        return [Caption(str(im["filename"]), int(s["sentid"]), str(s["raw"]).strip(), str(im["split"]))
                for im in data["images"] if split is None or im["split"] == split
                for s in im["sentences"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a Karpathy dataset file: missing or bad {e}") from None


def captions_by_image(captions: Sequence[Caption]) -> dict[str, list[str]]:
    """image_file -> its captions in file order."""
    grouped: dict[str, list[str]] = {}
    for c in captions:
        grouped.setdefault(c.image_file, []).append(c.caption)
    return grouped


# --- NLVR2 ---

@dataclass
class NLVR2Example:
    identifier: str  # "split-setid-pairid-sentenceid", e.g. "dev-850-0-0"
    sentence: str
    label: bool | None  # None when the file has no label
    left_image: str  # "split-setid-pairid-img0.png"
    right_image: str  # "split-setid-pairid-img1.png"
    left_url: str | None = None
    right_url: str | None = None
    directory: int | None = None  # train images live in train/<directory>/


def nlvr2_image_names(identifier: str) -> tuple[str, str]:
    """Image files of a pair, as the official repo derives them: drop the sentence id, add -img0/-img1.png."""
    parts = identifier.split("-")
    if len(parts) != 4:
        raise ValueError(f"NLVR2 identifier {identifier!r} is not split-setid-pairid-sentenceid")
    prefix = "-".join(parts[:3])
    return f"{prefix}-img0.png", f"{prefix}-img1.png"


def _nlvr2_label(value) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ValueError(f"label must be 'True' or 'False', got {value!r}")


def read_nlvr2(path: PathLike) -> list[NLVR2Example]:
    """NLVR2 JSONL (train.json / dev.json / test1.json): one example per line."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                left, right = nlvr2_image_names(row["identifier"])
                directory = row.get("directory")
                examples.append(NLVR2Example(
                    identifier=row["identifier"], sentence=str(row["sentence"]), label=_nlvr2_label(row.get("label")),
                    left_image=left, right_image=right, left_url=row.get("left_url"), right_url=row.get("right_url"),
                    directory=None if directory is None else int(directory)))
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{path} line {line_no}: bad NLVR2 example: {e}") from None
    return examples


def nlvr2_image_path(images_root: PathLike, example: NLVR2Example, side: int) -> Path:
    """Where the official image layout keeps one side (0 left, 1 right): train/<directory>/<name> or <split>/<name>."""
    name = (example.left_image, example.right_image)[side]
    split = example.identifier.split("-")[0]
    if example.directory is not None:
        return Path(images_root) / split / str(example.directory) / name
    return Path(images_root) / split / name
