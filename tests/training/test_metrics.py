"""Evaluation metrics against examples small enough to compute by hand (the working is in the comments)."""
from __future__ import annotations

import pytest
import torch

from models.spatial import pairwise_iou
from training.metrics import (
    accuracy, box_iou, confidence_baseline_accuracy, confidence_baseline_hits, gold_ranks, grounding_accuracy,
    grounding_hits, image_attention_fraction, recall_at_k, refer_accuracy, vqa_soft_accuracy,
)
from training.metrics import answer_type, vqa_accuracy_by_type


def test_vqa_soft_accuracy_by_hand():
    scores = torch.tensor([
        [1.0, 0.0, 0.3],
        [0.6, 0.0, 0.3],
        [0.0, 0.9, 0.0],
    ])
    # predicted answers 0, 2, 1 score 1.0, 0.3 and 0.9: mean 2.2 / 3
    assert vqa_soft_accuracy(torch.tensor([0, 2, 1]), scores) == pytest.approx(2.2 / 3)
    assert vqa_soft_accuracy(torch.tensor([1, 1, 0]), scores) == 0.0


def test_vqa_accuracy_by_answer_type_by_hand():
    assert [answer_type(a) for a in ("yes", "no", "3", "0", "red", "three")] == ["yes/no"] * 2 + ["number"] * 2 + ["other"] * 2
    # 4 questions over answers [yes, no, 2, red]; predictions: yes (right), yes (wrong), 2 (right), 2 (wrong: red)
    scores = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]])
    pred = torch.tensor([0, 0, 2, 2])
    types = ["yes/no", "yes/no", "number", "other"]
    assert vqa_accuracy_by_type(pred, scores, types) == {"yes/no": 0.5, "number": 1.0, "other": 0.0}
    assert vqa_accuracy_by_type(pred[:2], scores[:2], types[:2]) == {"yes/no": 0.5}  # absent types are left out


@pytest.mark.parametrize(
    "a,b,iou",
    [
        ([0, 0, 2, 2], [0, 0, 2, 2], 1.0),  # identical
        ([0, 0, 2, 2], [1, 1, 3, 3], 1 / 7),  # overlap 1, union 4 + 4 - 1
        ([0, 0, 4, 4], [1, 1, 3, 3], 4 / 16),  # contained: the inner area over the outer
        ([0, 0, 10, 10], [0, 0, 10, 5], 0.5),  # half
        ([0, 0, 1, 1], [1, 0, 2, 1], 0.0),  # sharing an edge only
        ([0, 0, 1, 1], [2, 2, 3, 3], 0.0),  # apart
        ([1, 1, 1, 1], [1, 1, 1, 1], 0.0),  # two empty boxes: no union, IoU 0 (not NaN)
    ],
)
def test_box_iou_by_hand(a, b, iou):
    got = box_iou(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32))
    assert got.item() == pytest.approx(iou)
    swapped = box_iou(torch.tensor(b, dtype=torch.float32), torch.tensor(a, dtype=torch.float32))
    assert swapped.item() == pytest.approx(iou)


def test_box_iou_broadcasts_to_pairwise():
    g = torch.Generator().manual_seed(0)
    lo = torch.rand(5, 2, generator=g)
    a = torch.cat([lo, lo + 0.5 * torch.rand(5, 2, generator=g)], -1)
    b = a.flip(0) + 0.1
    assert box_iou(a, b).shape == (5,)
    assert torch.allclose(box_iou(a[:, None], b[None]), pairwise_iou(a, b), atol=1e-6)


def test_refer_accuracy_by_hand():
    pred = torch.tensor([[0, 0, 2, 2], [0, 0, 2, 2], [0, 0, 10, 10]], dtype=torch.float32)
    gold = torch.tensor([[0, 0, 2, 2], [1, 1, 3, 3], [0, 0, 10, 5]], dtype=torch.float32)
    # IoUs 1, 1/7 and exactly 0.5 (which counts): 2 of 3
    assert refer_accuracy(pred, gold) == pytest.approx(2 / 3)
    assert refer_accuracy(pred, gold, thresh=0.51) == pytest.approx(1 / 3)


def test_accuracy_by_hand():
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [5.0, -1.0], [0.1, 0.2]])  # argmax 0, 1, 0, 1
    assert accuracy(logits, torch.tensor([0, 1, 1, 1])) == pytest.approx(3 / 4)
    choices = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]])  # multiple choice: argmax 1, 0
    assert accuracy(choices, torch.tensor([1, 2])) == pytest.approx(1 / 2)


# Four texts, four images; texts 0 and 1 both describe image 0, image 3 has no text.
SCORES = torch.tensor([
    #  img0  img1  img2  img3
    [0.9, 0.5, 0.1, 0.0],  # text 0 (gold 0): nothing above 0.9                       -> rank 0
    [0.2, 0.8, 0.3, 0.0],  # text 1 (gold 0): 0.8 and 0.3 are above 0.2               -> rank 2
    [0.4, 0.1, 0.7, 0.0],  # text 2 (gold 1): 0.4 and 0.7 are above 0.1               -> rank 2
    [0.6, 0.2, 0.5, 0.0],  # text 3 (gold 2): 0.6 is above 0.5                        -> rank 1
])
GOLD = torch.tensor([0, 0, 1, 2])
# image -> text, column by column (best gold text against the non-gold texts):
#   img0: gold texts 0, 1 -> best 0.9; no other text reaches it                     -> rank 0
#   img1: gold text 2 scores 0.1; texts 0 (0.5), 1 (0.8), 3 (0.2) are above          -> rank 3
#   img2: gold text 3 scores 0.5; text 2 (0.7) is above                               -> rank 1
#   img3: no text describes it                                                        -> left out


def test_recall_at_k_both_directions_by_hand():
    got = recall_at_k(SCORES, GOLD, ks=(1, 2, 3, 4))
    assert got["text_to_image"] == pytest.approx({1: 1 / 4, 2: 2 / 4, 3: 4 / 4, 4: 4 / 4})
    assert got["image_to_text"] == pytest.approx({1: 1 / 3, 2: 2 / 3, 3: 2 / 3, 4: 3 / 3})
    assert set(recall_at_k(SCORES, GOLD)["text_to_image"]) == {1, 5, 10}


def test_ranks_count_ties_against_the_gold():
    # constant scores rank the gold last, so a model that outputs a constant sits at chance (not at 100%)
    assert gold_ranks(torch.zeros(2, 3), torch.tensor([[True, False, False], [False, False, True]])).tolist() == [2, 2]
    # two gold columns tied with each other do not push each other down
    assert gold_ranks(torch.tensor([[0.5, 0.5, 0.1]]), torch.tensor([[True, True, False]])).tolist() == [0]
    got = recall_at_k(torch.ones(3, 3), torch.tensor([0, 1, 2]), ks=(1, 3))
    assert got == {"text_to_image": {1: 0.0, 3: 1.0}, "image_to_text": {1: 0.0, 3: 1.0}}


# Three regions and three entity words with their gold boxes.
REGIONS = torch.tensor([[0, 0, 2, 2], [2, 2, 4, 4], [0, 0, 4, 4]], dtype=torch.float32)
WORD_GOLD = torch.tensor([[0, 0, 2, 2], [2, 2, 4, 4], [0, 0, 4, 3]], dtype=torch.float32)
# IoU (word gold box, region):   r0     r1     r2
#   w0 [0,0,2,2]                 1      0      4/16
#   w1 [2,2,4,4]                 0      1      4/16
#   w2 [0,0,4,3]                 4/12   2/14   12/16
ATTENTION = torch.tensor([
    [[0.7, 0.1, 0.2], [0.1, 0.3, 0.6], [0.2, 0.2, 0.6]],  # head 0 picks r0, r2, r2: right, wrong, right -> 2/3
    [[0.1, 0.8, 0.1], [0.0, 0.9, 0.1], [0.5, 0.4, 0.1]],  # head 1 picks r1, r1, r0: wrong, right, wrong -> 1/3
])


def test_grounding_accuracy_per_head_by_hand():
    hits = grounding_hits(ATTENTION, WORD_GOLD, REGIONS)
    assert hits.tolist() == [[True, False, True], [False, True, False]]
    assert grounding_accuracy(ATTENTION, WORD_GOLD, REGIONS).tolist() == pytest.approx([2 / 3, 1 / 3])
    # at a 0.8 threshold w2's best region (IoU 0.75) no longer counts
    assert grounding_accuracy(ATTENTION, WORD_GOLD, REGIONS, thresh=0.8).tolist() == pytest.approx([1 / 3, 1 / 3])


def test_grounding_hits_sum_over_sentences():
    # a second sentence with one word that both heads ground right: corpus accuracy is (2+1, 1+1) of 4 words
    second = grounding_hits(torch.tensor([[[0.9, 0.1]], [[0.6, 0.4]]]), torch.tensor([[0.0, 0, 1, 1]]),
                            torch.tensor([[0.0, 0, 1, 1], [1, 1, 2, 2]]))
    both = torch.cat([grounding_hits(ATTENTION, WORD_GOLD, REGIONS), second], dim=1)
    assert both.float().mean(1).tolist() == pytest.approx([3 / 4, 2 / 4])


def test_confidence_baseline_by_hand():
    # the detector is most confident about r1: only w1's gold box matches it
    assert confidence_baseline_accuracy(torch.tensor([0.2, 0.9, 0.5]), WORD_GOLD, REGIONS) == pytest.approx(1 / 3)
    # most confident about r2: w2 (IoU 0.75) matches, w0 and w1 (0.25) do not
    assert confidence_baseline_accuracy(torch.tensor([0.2, 0.1, 0.5]), WORD_GOLD, REGIONS) == pytest.approx(1 / 3)
    assert confidence_baseline_accuracy(torch.tensor([0.2, 0.1, 0.5]), WORD_GOLD[2:], REGIONS) == 1.0


def test_grounding_hits_over_layers_and_heads():
    # a second layer whose heads swap the first layer's: (layers, heads, words) in one call
    stacked = torch.stack([ATTENTION, ATTENTION.flip(0)])  # (2, 2, 3, 3)
    hits = grounding_hits(stacked, WORD_GOLD, REGIONS)
    assert hits.shape == (2, 2, 3)
    assert hits.tolist() == [[[True, False, True], [False, True, False]], [[False, True, False], [True, False, True]]]
    assert grounding_accuracy(stacked, WORD_GOLD, REGIONS).flatten().tolist() == pytest.approx([2 / 3, 1 / 3, 1 / 3, 2 / 3])


def test_confidence_baseline_hits_by_hand():
    # most confident r2 [0,0,4,4]: IoU 1/4, 1/4 and 3/4 with the three gold boxes
    assert confidence_baseline_hits(torch.tensor([0.2, 0.1, 0.5]), WORD_GOLD, REGIONS).tolist() == [False, False, True]
    assert confidence_baseline_hits(torch.tensor([0.9, 0.1, 0.5]), WORD_GOLD, REGIONS).tolist() == [True, False, False]
    assert confidence_baseline_hits(torch.tensor([0.2, 0.1, 0.5]), WORD_GOLD, REGIONS, thresh=0.8).tolist() == [False] * 3


def test_image_attention_fraction_by_hand():
    # one head, 3 text tokens (the last is padding) over 2 real regions and 1 padding region
    attention = torch.tensor([[
        [0.1, 0.2, 0.3],  # 0.1 + 0.2 on real regions (the padding region's 0.3 does not count)
        [0.5, 0.4, 0.0],  # 0.9
        [1.0, 0.0, 0.0],  # a padding token: left out
    ]])
    got = image_attention_fraction(attention, torch.tensor([1, 1, 0]), torch.tensor([1, 1, 0]))
    assert got.tolist() == pytest.approx([(0.3 + 0.9) / 2])
    # leading dims are kept: (layers, heads)
    assert image_attention_fraction(attention.expand(2, 4, 3, 3), torch.tensor([1, 1, 0]), torch.tensor([1, 1, 0])).shape == (2, 4)
