"""The Python API's misuse: a batch or a head config the model would misread (or fail on deep inside torch) is a
ValueError/TypeError naming the field, on every preset, before any module runs."""
from __future__ import annotations

import pytest
import torch

from models import VLInputs, create_model
from models.config import HeadConfig
from models.inputs import check_inputs

PRESETS = ["visualbert", "vl-bert", "vilbert", "lxmert", "u-visualbert"]


def broken(batch: VLInputs, what: str) -> VLInputs:
    """`batch` with one mistake a caller makes."""
    b, n, d = batch.region_features.shape
    mistakes = {
        "one image for two texts": lambda: batch.replace(
            region_features=batch.region_features[:1], region_boxes=batch.region_boxes[:1],
            region_mask=batch.region_mask[:1], tag_ids=None if batch.tag_ids is None else batch.tag_ids[:1]),
        "a mask of another batch": lambda: batch.replace(attention_mask=batch.attention_mask[:1]),
        "features without a batch": lambda: batch.replace(region_features=batch.region_features[0]),
        "another feature width": lambda: batch.replace(region_features=torch.zeros(b, n, d + 1)),
        "float64 features": lambda: batch.replace(region_features=batch.region_features.double()),
        "float ids": lambda: batch.replace(input_ids=batch.input_ids.float()),
        "ids past the vocabulary": lambda: batch.replace(input_ids=batch.input_ids + 10**6),
        "a text past the positions": lambda: batch.replace(
            input_ids=batch.input_ids.repeat(1, 100), attention_mask=batch.attention_mask.repeat(1, 100),
            token_type_ids=batch.token_type_ids.repeat(1, 100)),
        "a row without a token": lambda: batch.replace(attention_mask=torch.zeros_like(batch.attention_mask)),
        "a mask of 2": lambda: batch.replace(region_mask=batch.region_mask * 2),
        "no regions": lambda: batch.replace(
            region_features=batch.region_features[:, :0], region_boxes=batch.region_boxes[:, :0],
            region_mask=batch.region_mask[:, :0], tag_ids=None if batch.tag_ids is None else batch.tag_ids[:, :0]),
        "NaN features": lambda: batch.replace(region_features=batch.region_features.masked_fill(
            torch.zeros_like(batch.region_features, dtype=torch.bool).index_fill_(2, torch.tensor([0]), True),
            float("nan"))),
        "x, y, w, h boxes": lambda: batch.replace(region_boxes=torch.cat(
            [batch.region_boxes[..., 2:], batch.region_boxes[..., :2] * 0.1], -1)),
        "pixel boxes": lambda: batch.replace(region_boxes=batch.region_boxes * 600),
        "a list for a tensor": lambda: batch.replace(region_mask=batch.region_mask.tolist()),
    }
    return mistakes[what]()


EXPECTED = {
    "one image for two texts": (ValueError, "the text's batch \\(2\\) and the regions' \\(1\\) differ"),
    "a mask of another batch": (ValueError, "attention_mask \\(1, .*\\) must have input_ids' shape"),
    "features without a batch": (ValueError, "region_features must be \\(B, N, D\\)"),
    "another feature width": (ValueError, "are 17-d; this model reads 16-d"),
    "float64 features": (TypeError, "region_features is float64; this model's weights are torch.float32"),
    "float ids": (TypeError, "input_ids must be an integer tensor"),
    "ids past the vocabulary": (ValueError, "input_ids must lie in \\[0, "),
    "a text past the positions": (ValueError, "tokens, more than the model's .* text positions"),
    "a row without a token": (ValueError, "attention_mask: a row without a real token"),
    "a mask of 2": (ValueError, "region_mask must lie in \\[0, 1\\]"),
    "no regions": (ValueError, "no regions \\(N = 0\\)"),
    "NaN features": (ValueError, "region_features has NaN or infinite values"),
    "x, y, w, h boxes": (ValueError, "region_boxes of real regions must be x1, y1, x2, y2"),
    "pixel boxes": (ValueError, "region_boxes of real regions must be x1, y1, x2, y2 in \\[0, 1\\]"),
    "a list for a tensor": (TypeError, "region_mask must be a torch.Tensor, not list"),
}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("what", list(EXPECTED))
def test_a_misused_batch_is_named_before_the_model_runs(preset, what, make_model, make_batch):
    model = make_model(preset, "vqa", "refer").eval()
    batch = make_batch(model.config.encoder, batch=2)
    with torch.no_grad():
        model(batch, "vqa")  # the batch itself is well formed
        kind, message = EXPECTED[what]
        with pytest.raises(kind, match=message):
            model(broken(batch, what), "vqa")


def test_head_layouts_are_checked_against_the_head(make_model, make_batch):
    model = make_model("visualbert", "vqa", "nlvr2", "multiple_choice").eval()
    enc = model.config.encoder
    with torch.no_grad(), pytest.raises(ValueError, match="region_features must be \\(B, 2, N, D\\) for this head"):
        model(make_batch(enc), "nlvr2")
    with torch.no_grad(), pytest.raises(ValueError, match="input_ids must be \\(B, C, T\\) for this head"):
        model(make_batch(enc), "multiple_choice")
    with torch.no_grad(), pytest.raises(ValueError, match="region_features must be \\(B, N, D\\) for this head"):
        model(make_batch(enc, head="nlvr2"), "vqa")
    for head in ("nlvr2", "multiple_choice"):  # each laid out as its head reads it
        with torch.no_grad():
            assert torch.isfinite(model(make_batch(enc, head=head), head).logits).all()


def test_padding_regions_may_hold_any_finite_box(make_model, make_batch):
    """Only real regions' boxes are read: a padding region's box (mask 0) is not checked."""
    model = make_model("lxmert", "vqa").eval()
    batch = make_batch(model.config.encoder, batch=2)
    assert not batch.region_mask[1].all()
    boxes = batch.region_boxes.clone()
    boxes[batch.region_mask == 0] = torch.tensor([0.9, 0.9, 0.1, 0.1])
    with torch.no_grad():
        assert torch.equal(model(batch.replace(region_boxes=boxes), "vqa").logits, model(batch, "vqa").logits)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:FutureWarning")  # what export's TorchScript path uses
def test_tracing_skips_the_checks():
    """Export traces the forward: value checks would be baked into the graph as constants, so none runs then."""
    calls = []

    def traced(ids: torch.Tensor) -> torch.Tensor:
        inputs = VLInputs(ids, ids, ids, torch.zeros(1, 1, 3), torch.zeros(1, 1, 4), torch.ones(1, 1, dtype=torch.long))
        check_inputs(inputs, vocab_size=1, type_vocab_size=1, feature_dim=99, text_positions=1,
                     weight_dtype=torch.float32)  # everything is wrong: it would raise outside tracing
        calls.append(1)
        return ids + 1

    torch.jit.trace(traced, (torch.ones(1, 2, dtype=torch.long),), check_trace=False)  # no eager re-run
    assert calls


@pytest.mark.parametrize("fields, message", [
    ({"num_labels": 13.0}, "head vqa: num_labels=13.0 is not an integer"),
    ({"num_labels": "13"}, "head vqa: num_labels='13' is not an integer"),
    ({"num_labels": True}, "head vqa: num_labels=True is not an integer"),
    ({"num_labels": None}, "head vqa: num_labels=None is not an integer"),
    ({"num_labels": 3, "classifier_hidden": -5}, "head vqa: classifier_hidden=-5 must be at least 0"),
    ({"num_labels": 3, "pool": 1}, "head vqa: pool=1 is not a string"),
])
def test_a_head_config_of_the_wrong_types_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        HeadConfig(kind="vqa", **fields)


def test_heads_and_task_tokens_are_checked_against_the_encoder():
    with pytest.raises(TypeError, match="heads must be a dict of task name -> HeadConfig or its fields, not list"):
        create_model("lxmert", "tiny", heads=[{"kind": "vqa", "num_labels": 3}])
    with pytest.raises(ValueError, match="head 'vqa': task_token=2 but the encoder has no task tokens \\(a lxmert"):
        create_model("lxmert", "tiny", heads={"vqa": {"kind": "vqa", "num_labels": 3, "task_token": 2}})
    with pytest.raises(ValueError, match="task_token=4 but the encoder has its 4 task tokens"):
        create_model("vilbert", "tiny", task_tokens=4, heads={"vqa": {"kind": "vqa", "num_labels": 3, "task_token": 4}})
    create_model("vilbert", "tiny", task_tokens=4, heads={"vqa": {"kind": "vqa", "num_labels": 3, "task_token": 3}})
