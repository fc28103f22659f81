"""models.attention: the explained pass answers what the task's forward answers, and each image's attention is the
grounding analysis' text_region_attention of that image alone (NLVR2 pairs and joint sequences included)."""
from __future__ import annotations

import pytest
import torch

from models import PRESETS, create_model
from models.attention import explained_forward, text_region_attention


@pytest.mark.parametrize("preset", PRESETS)
def test_explained_forward_is_the_task_forward_with_its_attention(preset, make_batch):
    torch.manual_seed(0)
    model = create_model(preset, "tiny", heads={"vqa": {"kind": "vqa", "num_labels": 5}}).eval()
    inputs = make_batch(model.config.encoder)
    with torch.inference_mode():
        logits, per_image = explained_forward(model, inputs, "vqa")
        expected = model(inputs, "vqa").logits
        reference = text_region_attention(model, inputs)  # (L, B, heads, T, N)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert len(per_image) == inputs.input_ids.shape[0]
    for b, attention in enumerate(per_image):
        torch.testing.assert_close(attention, reference[:, b], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["pair", "joint"])
def test_nlvr2_lists_each_image_of_each_pair(mode, make_batch):
    torch.manual_seed(0)
    model = create_model("visualbert", "tiny", heads={"nlvr2": {"kind": "nlvr2", "nlvr2_mode": mode}}).eval()
    inputs = make_batch(model.config.encoder, head="nlvr2")  # regions (B, 2, N, ...)
    b, _, n = inputs.region_mask.shape
    with torch.inference_mode():
        logits, per_image = explained_forward(model, inputs, "nlvr2")
        torch.testing.assert_close(logits, model(inputs, "nlvr2").logits, atol=1e-5, rtol=1e-5)
        prepared = model.heads["nlvr2"].prepare(inputs)
        reference = text_region_attention(model, prepared)  # pair: (L, 2B, ..., N); joint: (L, B, ..., 2N)
    assert len(per_image) == 2 * b and all(a.shape[-1] == n for a in per_image)
    for i, attention in enumerate(per_image):
        row, image = divmod(i, 2)
        expected = reference[:, i] if mode == "pair" else reference[:, row, ..., image * n : (image + 1) * n]
        torch.testing.assert_close(attention, expected, atol=1e-6, rtol=1e-5)
