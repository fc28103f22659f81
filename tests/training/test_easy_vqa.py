"""The easy-VQA adapter on the real published dataset (the `easy-vqa` package)."""
from __future__ import annotations

import os

import pytest

import easy_vqa  # noqa: F401  # pinned dependency: the dataset ships inside it

from training.data.easy_vqa import easy_vqa_answers, load_easy_vqa, load_image  # noqa: E402


@pytest.fixture(scope="module")
def splits():
    return {name: load_easy_vqa(name) for name in ("train", "test")}


def test_published_sizes(splits):
    assert (len(splits["train"].examples), len(splits["train"].image_paths)) == (38575, 4000)
    assert (len(splits["test"].examples), len(splits["test"].image_paths)) == (9673, 1000)


def test_answer_vocabulary(splits):
    answers = easy_vqa_answers()
    assert len(answers) == 13 and {"yes", "no", "circle", "rectangle", "triangle", "red"} <= set(answers)
    for split in splits.values():
        assert split.answers == answers
        assert all(answers[ex.answer_id] == ex.answer for ex in split.examples)


def test_examples_point_into_the_package(splits):
    first = splits["train"].examples[0]
    assert first.question == "what is the blue shape?" and first.answer == "rectangle" and first.image_id == 0
    assert os.path.isfile(first.image_path) and "easy_vqa" in first.image_path  # not copied into the repo
    pixels = load_image(splits["test"].examples[0].image_path)
    assert pixels.shape == (64, 64, 3) and pixels.dtype.name == "uint8"


def test_unknown_split():
    with pytest.raises(ValueError, match="split"):
        load_easy_vqa("val")
