"""Retrieval R@K both ways from pair scores: hand-computed ranks, query sampling, true-match keys, every preset's ITM head."""
import numpy as np
import pytest
import torch

from models import HeadConfig, create_model
from models.config import PRESETS
from models.tokenizer import VLTokenizer
from training.data.region_table import RegionTable
from training.data.shapes_cache import ShapesSplit
from training.data.vl_tasks import Example, retrieval_examples
from training.retrieval import itm_scorer, query_sample, retrieval_recall, score_grid, training_bank

# caption t (row) x image i (column); caption t is the gold caption of image t
SCORES = np.array([
    [5.0, 1.0, 0.0, 0.0],  # gold first
    [6.0, 2.0, 0.0, 0.0],  # image 0 above the gold
    [0.0, 0.0, 3.0, 4.0],  # image 3 above the gold
    [0.0, 0.0, 1.0, 5.0],  # gold first
])
TEXT_TO_IMAGE_RANKS = np.array([0, 1, 1, 0])  # per caption, by hand
IMAGE_TO_TEXT_RANKS = np.array([1, 0, 0, 0])  # per image: column 0 puts caption 1 (6) above caption 0 (5)


class HandScorer:
    """Looks pairs up in SCORES and records the batches it was asked for."""

    def __init__(self):
        self.batches = []

    def __call__(self, texts, images):
        self.batches.append(len(texts))
        return torch.from_numpy(SCORES[texts, images])


def test_recall_at_k_both_ways_matches_the_hand_computed_ranks():
    scorer = HandScorer()
    result = retrieval_recall(scorer, pool=4, queries=None, ks=(1, 2), batch_size=3)
    assert result["queries"] == 4 and result["pool"] == 4
    assert result["text_to_image"] == {"R@1": 0.5, "R@2": 1.0}
    assert result["image_to_text"] == {"R@1": 0.75, "R@2": 1.0}
    assert sum(scorer.batches) == 2 * 4 * 4 and max(scorer.batches) == 3  # every pair, in batches of at most 3


def test_one_direction_scores_half_the_pairs_and_agrees_with_both():
    both = retrieval_recall(HandScorer(), pool=4, queries=None, keys=["a", "a", "b", "c"], ks=(1, 2))
    for direction, other in (("text_to_image", "image_to_text"), ("image_to_text", "text_to_image")):
        scorer = HandScorer()
        one = retrieval_recall(scorer, pool=4, queries=None, keys=["a", "a", "b", "c"], ks=(1, 2), directions=(direction,))
        assert sum(scorer.batches) == 4 * 4
        assert one[direction] == both[direction] and one[f"{direction}_any_true"] == both[f"{direction}_any_true"]
        assert other not in one and f"{other}_any_true" not in one
        assert one["true_images_per_caption"] == both["true_images_per_caption"]
    with pytest.raises(ValueError, match="retrieval directions"):
        retrieval_recall(HandScorer(), pool=4, directions=("sideways",))


def test_sampled_queries_rank_against_the_whole_pool():
    q = query_sample(4, 2, seed=3)
    assert len(q) == 2 and list(q) == sorted(set(q)) and list(query_sample(4, 2, seed=3)) == list(q)
    result = retrieval_recall(HandScorer(), pool=4, queries=2, ks=(1,), seed=3)
    assert result["text_to_image"]["R@1"] == pytest.approx((TEXT_TO_IMAGE_RANKS[q] < 1).mean())
    assert result["image_to_text"]["R@1"] == pytest.approx((IMAGE_TO_TEXT_RANKS[q] < 1).mean())


def test_keys_count_true_matches_and_any_true_recall():
    # captions 0 and 1 describe images 0 and 1 alike: caption 1 is true of image 0, which it scores highest
    result = retrieval_recall(HandScorer(), pool=4, queries=None, keys=["a", "a", "b", "c"], ks=(1,))
    assert result["true_images_per_caption"] == 1.5 and result["ambiguous_queries"] == 2
    assert result["text_to_image_any_true"] == {"R@1": 0.75}  # caption 2 still ranks image 3 first
    assert result["image_to_text_any_true"] == {"R@1": 1.0}
    assert result["text_to_image"] == {"R@1": 0.5}  # the standard metric counts only the gold image


def test_priors_rank_text_to_image_by_the_normalised_scores_and_keep_the_raw_recall():
    """Image 0 is a hub (prior log 1000): by hand, caption 0's gold image 0 drops to the last place
    (5 - log(1000 + e^5) = -2.05 against image 1's 1 - log(1 + e) = -0.31, images 2 and 3 at -log 2), caption 1's
    gold image 1 rises to the first; image -> text does not change (a fixed image's order of captions stays)."""
    priors = torch.tensor([np.log(1000.0), 0.0, 0.0, 0.0])
    plain = retrieval_recall(HandScorer(), pool=4, queries=None, ks=(1, 2))
    result = retrieval_recall(HandScorer(), pool=4, queries=None, ks=(1, 2), priors=priors, temperature=1.0)
    assert result["text_to_image_raw"] == plain["text_to_image"] == {"R@1": 0.5, "R@2": 1.0}
    assert result["text_to_image"] == {"R@1": 0.5, "R@2": 0.75}  # captions 1 and 3 first; caption 0's gold third
    assert result["image_to_text"] == plain["image_to_text"]


def test_the_training_bank_draws_distinct_training_captions_with_its_own_generator():
    examples = [Example((i,), f"caption {i % 7}", None) for i in range(20)]
    bank = training_bank(examples, 5, 0.5, seed=3)
    assert len(set(bank.texts)) == 5 and set(bank.texts) <= {f"caption {i}" for i in range(7)}
    assert bank == training_bank(examples, 5, 0.5, seed=3) and bank.temperature == 0.5
    assert training_bank(examples, 7, 1.0).texts == tuple(f"caption {i}" for i in range(7))  # all of them, in order
    with pytest.raises(ValueError, match="needs as many distinct training captions, found 7"):
        training_bank(examples, 8, 1.0)


def test_score_grid_does_not_depend_on_the_batch_size():
    texts, images = np.array([3, 0]), np.array([1, 2, 3])
    a, b = score_grid(HandScorer(), texts, images, batch_size=1), score_grid(HandScorer(), texts, images, batch_size=100)
    assert torch.equal(a, b) and torch.equal(a, torch.from_numpy(SCORES[np.ix_(texts, images)]).float())


def test_retrieval_examples_use_the_listing_and_the_object_multiset():
    objects = lambda *descs: [{"size": z, "color": c, "shape": s, "box": [0, 0, 1, 1]} for z, c, s in descs]  # noqa: E731
    annotations = [
        {"captions": ["a small red circle and a large blue triangle.", "there is a red object."],
         "objects": objects(("small", "red", "circle"), ("large", "blue", "triangle"))},
        {"captions": ["a large blue triangle and a small red circle.", "there is a blue object."],
         "objects": objects(("large", "blue", "triangle"), ("small", "red", "circle"))},
        {"captions": ["a small red circle."], "objects": objects(("small", "red", "circle"))},
    ]
    examples = retrieval_examples(ShapesSplit(None, annotations, []), row_offset=5)
    assert [e.text for e in examples] == [a["captions"][0] for a in annotations]
    assert [e.rows for e in examples] == [(5,), (6,), (7,)]
    assert examples[0].label == examples[1].label != examples[2].label  # same objects in another order: both true


@pytest.mark.parametrize("preset", PRESETS)
def test_itm_scorer_on_every_preset_matches_pair_by_pair_scores(preset):
    torch.manual_seed(0)
    model = create_model(preset, "tiny", heads={"itm": HeadConfig(kind="itm")})
    d, n, m = model.config.encoder.visual_feat_dim, 5, 3
    rng = np.random.default_rng(0)
    lo = rng.uniform(0, 0.5, (m, n, 2)).astype(np.float32)
    boxes = np.concatenate([lo, lo + 0.3], -1)
    mask = (np.arange(n) < np.array([[5], [3], [4]])).astype(np.int64)
    table = RegionTable(features=rng.normal(size=(m, n, d)).astype(np.float16), boxes=boxes, pixel_boxes=boxes * 64,
                        mask=mask, obj_ids=np.where(mask, 0, -1), image_feature=None)
    examples = [Example((i,), text, ()) for i, text in enumerate(["a red circle.", "there is a small blue triangle to the left.", "two."])]
    scorer = itm_scorer(model, "itm", examples, table, VLTokenizer.pretrained_minilm())
    grid = score_grid(scorer, np.arange(m), np.arange(m), batch_size=4)  # batches mix caption lengths
    one_by_one = torch.stack([scorer(np.array([t]), np.array([i]))[0] for t in range(m) for i in range(m)]).reshape(m, m)
    assert grid.shape == (m, m) and torch.allclose(grid, one_by_one, atol=1e-4)
