"""The pipeline's pure pieces: post-processing math, strict base64, task selection by head kind."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from models import HeadConfig, ModelConfig
from service.pipeline import (TaskSpec, best, match_scores, rank, ranked_regions, region_arrays, task_specs, top_answers,
                              true_probability)
from service.schemas import decode_base64
from tests.service.conftest import random_regions


def test_top_answers_are_sigmoid_scores_best_first():
    logits = np.array([0.0, 2.0, -1.0, 2.0], np.float32)
    got = top_answers(logits, ["a", "b", "c", "d"], 3)
    assert [a for a, _ in got] == ["b", "d", "a"]  # ties keep the vocabulary order
    assert got[0][1] == pytest.approx(1 / (1 + np.exp(-2.0))) and got[2][1] == pytest.approx(0.5)


def test_best_is_a_stable_descending_sort_cut_at_k():
    """best() equals a full stable sort's first k, ties at the cut included, for k from 1 past the end."""
    rng = np.random.default_rng(0)
    for values in (rng.standard_normal(3129).astype(np.float32), rng.integers(0, 4, 200).astype(np.float32),
                   np.zeros(7, np.float32)):
        full = np.argsort(-values, kind="stable")
        for k in (1, 2, 3, 5, 50, len(values), len(values) + 3):
            assert best(values, k).tolist() == full[:k].tolist(), k


def test_top_answers_of_a_cross_entropy_head_are_softmax_probabilities():
    logits = np.array([0.0, 2.0, -1.0, 1.0], np.float32)
    got = top_answers(logits, ["a", "b", "c", "d"], 4, score="softmax")
    probs = np.exp(logits) / np.exp(logits).sum()
    assert [a for a, _ in got] == ["b", "d", "a", "c"]
    assert [p for _, p in got] == pytest.approx(sorted(probs, reverse=True)) and sum(p for _, p in got) == pytest.approx(1)


def test_ranked_regions_ignore_padding():
    logits = np.array([1.0, 3.0, 2.0, -1e4, -1e4], np.float32)  # two padded regions
    got = ranked_regions(logits, num_boxes=3, k=5)
    assert [i for i, _ in got] == [1, 2, 0]
    probs = np.exp([1.0, 3.0, 2.0]) / np.exp([1.0, 3.0, 2.0]).sum()
    assert [p for _, p in got] == pytest.approx([probs[1], probs[2], probs[0]])


def test_match_scores_are_logit_differences_and_softmax_probabilities():
    logits = np.array([[0.0, 1.0], [2.0, -2.0], [0.5, 0.5]], np.float32)
    score, prob = match_scores(logits)
    assert score == pytest.approx([1.0, -4.0, 0.0])
    softmax = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    assert prob == pytest.approx(softmax[:, 1])
    assert rank(score, 2) == [0, 2]


def test_true_probability_is_softmax_of_the_true_logit():
    assert true_probability(np.array([0.0, 0.0])) == pytest.approx(0.5)
    assert true_probability(np.array([-3.0, 1.0])) == pytest.approx(1 / (1 + np.exp(-4.0)))


def test_task_specs_pick_the_first_head_of_each_served_kind():
    tasks = {"mlm": "mlm", "gqa": "vqa", "vqa": "vqa", "itm": "itm", "match": "itm"}
    heads = {"gqa": HeadConfig(kind="vqa", num_labels=2, pool="answer_slot"), "itm": HeadConfig(kind="itm")}
    specs = task_specs(tasks, heads, {"heads": {"gqa": ["yes", "no"]}})
    assert set(specs) == {"vqa", "itm"}
    assert specs["vqa"].task == "gqa" and specs["vqa"].labels == ("yes", "no")
    assert specs["vqa"].answer_slot == "answer_slot"
    assert specs["itm"].task == "itm" and not specs["itm"].answer_slot
    assert specs["vqa"].score == "sigmoid"


def test_task_specs_read_the_semantics_the_head_declares_not_its_training_options():
    declared = HeadConfig(kind="vqa", num_labels=2, vqa_loss="bce", score="softmax", text_layout="answer_segment")
    spec = task_specs({"vqa": "vqa"}, {"vqa": declared}, {})["vqa"]
    assert spec.score == "softmax" and spec.answer_slot == "answer_segment"
    assert task_specs({"vqa": "vqa"}, {}, {})["vqa"] == TaskSpec("vqa", "vqa")  # no config: plain text, sigmoids


@pytest.mark.parametrize(("old", "score", "layout"), [
    ({}, "sigmoid", "plain"),
    ({"vqa_loss": "ce"}, "softmax", "plain"),
    ({"pool": "answer_slot"}, "sigmoid", "answer_slot"),
    ({"pool": "answer_segment", "vqa_loss": "ce"}, "softmax", "answer_segment"),
])
def test_a_config_written_before_heads_declared_semantics_serves_as_it_was_trained(old, score, layout):
    """config.json heads without score / text_layout get them from vqa_loss and pool when loaded."""
    head = {"kind": "vqa", "num_labels": 3, **old}
    config = ModelConfig.from_dict({"encoder": {"preset": "visualbert"}, "heads": {"vqa": head}})
    head = config.heads["vqa"]
    assert (head.score, head.text_layout) == (score, layout)
    spec = task_specs({"vqa": "vqa"}, config.heads, {"heads": {"vqa": ["a", "b", "c"]}})["vqa"]
    logits = np.array([2.0, -1.0, 0.5])
    expected = (np.exp(logits) / np.exp(logits).sum()) if score == "softmax" else 1 / (1 + np.exp(-logits))
    assert top_answers(logits, spec.labels, 1, spec.score) == [("a", pytest.approx(expected[0]))]
    assert spec.answer_slot == (False if layout == "plain" else layout)
    written = config.to_dict()["heads"]["vqa"]  # a config written now declares them
    assert (written["score"], written["text_layout"]) == (score, layout)
    assert ModelConfig.from_dict(config.to_dict()).heads["vqa"] == head


def test_a_head_cannot_declare_a_layout_without_the_slot_it_reads():
    with pytest.raises(ValueError, match="answer slot"):
        HeadConfig(kind="vqa", num_labels=2, pool="answer_slot", text_layout="plain")
    with pytest.raises(ValueError, match="score"):
        HeadConfig(kind="refer", score="softmax")


def test_retrieve_ranks_with_the_ranking_head_where_the_model_has_one():
    tasks = {"vqa": "vqa", "itm": "itm", "rank": "itm", "nlvr2": "nlvr2"}
    specs = task_specs(tasks, {}, {})
    assert specs["itm"].task == "rank" and specs["vqa"].task == "vqa" and specs["nlvr2"].task == "nlvr2"
    assert task_specs({"itm": "itm", "rank": "vqa"}, {}, {})["itm"].task == "itm"  # a "rank" head of another kind


@pytest.mark.parametrize("text", [
    base64.b64encode(b"\x89PNG\r\n\x1a\n-bytes").decode(),
    "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n-bytes").decode(),
    base64.urlsafe_b64encode(b"\x89PNG\r\n\x1a\n-bytes").decode().rstrip("="),
    "\n".join(base64.encodebytes(b"\x89PNG\r\n\x1a\n-bytes").decode().split("\n")),
])
def test_base64_forms_accepted(text):
    assert decode_base64(text) == b"\x89PNG\r\n\x1a\n-bytes"


@pytest.mark.parametrize("value", ["", "   ", "abc$", "a", "====", 12, None, b"aGk="])
def test_base64_refused(value):
    with pytest.raises(ValueError):
        decode_base64(value)


def test_region_arrays_give_each_region_its_class_word_as_tag():
    words = np.array([2000, 3000, 4000])  # detector class id -> word id
    one, two = random_regions(1, n_real=3, n=5), random_regions(2, n_real=4, n=5)
    assert "tag_ids" not in region_arrays([one])
    single = region_arrays([one], words)["tag_ids"]
    assert single.dtype == np.int64 and single.tolist() == [*words[one.obj_ids[:3]].tolist(), -1, -1]
    pair = region_arrays([one, two], words)["tag_ids"]  # NLVR2: (2, N)
    assert pair.tolist() == [single.tolist(), [*words[two.obj_ids[:4]].tolist(), -1]]
