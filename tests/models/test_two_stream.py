"""Two-stream split: forward = fuse(encode_text, encode_image), and fusing states encoded one row at a time
(padded again, in any pairing) gives what the full forward gives on the padded batch."""
from __future__ import annotations

import pytest
import torch

from models import VLInputs
from models.two_stream import StreamStates

TWO_STREAM = ("lxmert", "vilbert")


def run_split(encoder, x: VLInputs, output_attentions: bool = False):
    text = encoder.encode_text(x.input_ids, x.attention_mask, x.token_type_ids, output_attentions)
    image = encoder.encode_image(x.region_features, x.region_boxes, x.region_mask, x.image_feature)
    return encoder.fuse(text, image, output_attentions)


@pytest.mark.parametrize("preset", TWO_STREAM)
@pytest.mark.parametrize("output_attentions", [False, True])
def test_forward_is_fuse_of_the_two_encodes(preset, output_attentions, make_model, make_batch):
    model = make_model(preset, "itm").eval()
    x = make_batch(model.config.encoder, batch=3)
    with torch.no_grad():
        full = model.encoder(**x.encoder_kwargs(), output_attentions=output_attentions)
        split = run_split(model.encoder, x, output_attentions)
    for name in ("text", "image", "pooled"):
        assert torch.equal(getattr(full, name), getattr(split, name)), name
    if output_attentions:
        assert len(full.attentions) == len(split.attentions) == model.config.encoder.num_layers
        assert all(torch.equal(a, b) for a, b in zip(full.attentions + full.cross_attentions,
                                                     split.attentions + split.cross_attentions))


@pytest.mark.parametrize("preset", TWO_STREAM)
def test_states_encoded_alone_and_fused_in_other_pairs_equal_the_full_forward(preset, make_model, make_batch):
    """The retrieval path: every text and image encoded alone (cut to its real tokens), then paired as a ranking
    pairs them, padded again, fused; pooled and ITM logits equal the full forward of those pairs."""
    model = make_model(preset, "itm").eval()
    enc = model.encoder
    x = make_batch(model.config.encoder, batch=3)  # rows have 7, 6, 5 real tokens and 5, 4, 3 real regions
    pairs = [(0, 0), (0, 1), (0, 2), (2, 1), (1, 2)]  # one text x several images, one image x several texts
    with torch.no_grad():
        texts = [enc.encode_text(x.input_ids[i : i + 1], x.attention_mask[i : i + 1], x.token_type_ids[i : i + 1])
                 .row(0, int(x.attention_mask[i].sum())) for i in range(3)]
        images = [enc.encode_image(x.region_features[i : i + 1], x.region_boxes[i : i + 1], x.region_mask[i : i + 1])
                  for i in range(3)]
        text_rows, image_rows = (StreamStates.cat([texts[t] for t, _ in pairs]),
                                 StreamStates.cat([images[i] for _, i in pairs]))
        fused = enc.fuse(text_rows, image_rows)
        t, i = (torch.tensor(side) for side in zip(*pairs))
        paired = x.replace(input_ids=x.input_ids[t], attention_mask=x.attention_mask[t], token_type_ids=x.token_type_ids[t],
                           region_features=x.region_features[i], region_boxes=x.region_boxes[i], region_mask=x.region_mask[i],
                           tag_ids=None, phrase_index=None)
        full = model(paired, "itm")
        logits = model.match_streams("itm", text_rows, image_rows)
    torch.testing.assert_close(fused.pooled, full.encoder.pooled, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, full.logits, atol=1e-5, rtol=1e-5)


def test_stream_states_row_cat_and_nbytes():
    states = StreamStates(torch.arange(24.0).view(2, 3, 4), torch.tensor([[1, 1, 0], [1, 1, 1]]))
    first = states.row(0, 2)
    assert first.hidden.shape == (1, 2, 4) and first.mask.tolist() == [[1, 1]]
    assert first.hidden.untyped_storage().nbytes() == 2 * 4 * 4, "a row is a copy, not a view of the batch"
    assert first.nbytes == 2 * 4 * 4 + 2 * 8
    both = StreamStates.cat([first, states.row(1)])
    assert both.hidden.shape == (2, 3, 4) and both.mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert not both.hidden[0, 2].any() and torch.equal(both.hidden[1], states.hidden[1])
    with pytest.raises(ValueError, match="no stream states"):
        StreamStates.cat([])
