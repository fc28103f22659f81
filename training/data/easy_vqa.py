"""easy-VQA (the `easy-vqa` package, v1.0) as a VQA dataset: train / test as published, 13 answers.

Images stay inside the installed package; examples carry their paths. Published sizes: train 4,000 images /
38,575 questions, test 1,000 images / 9,673 questions, all 64x64 RGB PNG.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

SPLITS = ("train", "test")


@dataclass(frozen=True)
class EasyVQAExample:
    image_id: int
    image_path: str  # inside the installed easy_vqa package
    question: str
    answer: str
    answer_id: int  # index in the package's answer list


@dataclass
class EasyVQASplit:
    name: str  # "train" or "test"
    examples: list[EasyVQAExample]
    answers: list[str]  # the vocabulary, in the package's order
    image_paths: dict[int, str]  # image_id -> PNG path


def _package():
    try:
        import easy_vqa
    except ImportError:  # a clear message beats a bare ModuleNotFoundError deep in a training run
        raise ImportError("easy-VQA needs the `easy-vqa` package: pip install easy-vqa==1.0") from None
    return easy_vqa


def easy_vqa_answers() -> list[str]:
    """The 13 answers, in the order the package lists them (answer_id = index)."""
    return _package().get_answers()


def load_easy_vqa(split: str) -> EasyVQASplit:
    """One published split with every question; raises ValueError for an unknown split or a dangling image id."""
    if split not in SPLITS:
        raise ValueError(f"easy-VQA split must be one of {SPLITS}, got {split!r}")
    pkg = _package()
    texts, answers, image_ids = pkg.get_train_questions() if split == "train" else pkg.get_test_questions()
    image_paths = pkg.get_train_image_paths() if split == "train" else pkg.get_test_image_paths()
    vocabulary = pkg.get_answers()
    answer_ids = {a: i for i, a in enumerate(vocabulary)}
    examples = []
    for question, answer, image_id in zip(texts, answers, image_ids, strict=True):
        if image_id not in image_paths or answer not in answer_ids:
            raise ValueError(f"easy-VQA {split}: question {question!r} has unknown image {image_id} or answer {answer!r}")
        examples.append(EasyVQAExample(image_id, image_paths[image_id], question, answer, answer_ids[answer]))
    return EasyVQASplit(split, examples, vocabulary, image_paths)


def load_image(path: str) -> np.ndarray:
    """(H, W, 3) uint8 RGB pixels of one easy-VQA image."""
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))
