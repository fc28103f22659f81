"""models.layers.Packing: the encoder layers' token-wise work on the real tokens only gives the padded computation's
outputs and gradients at every real token, zeros at the padding, and stays off where packing would not pay."""
from __future__ import annotations

import pytest
import torch

from models.layers import Packing

PADDED = staticmethod(lambda mask: False)


def run(model, inputs, head: str, packed: bool, monkeypatch):
    monkeypatch.setattr(Packing, "worthwhile", staticmethod(lambda mask: True) if packed else PADDED)
    model.zero_grad(set_to_none=True)
    out = model(inputs, head)
    out.logits.float().pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    encoded = model.encoder(inputs.input_ids, inputs.attention_mask, inputs.token_type_ids, inputs.region_features,
                            inputs.region_boxes, inputs.region_mask)
    return out.logits.detach(), grads, encoded


@pytest.mark.parametrize("preset", ["visualbert", "u-visualbert", "vl-bert"])
@pytest.mark.parametrize("head", ["vqa", "refer", "itm"])
def test_packed_layers_compute_what_the_padded_batch_does(preset, head, make_model, make_batch, monkeypatch):
    model = make_model(preset, head, dropout=0.0, attention_dropout=0.0).train()
    inputs = make_batch(model.config.encoder, batch=4, seed=3)  # rows with 0 to 3 padded words and regions
    padded_logits, padded_grads, padded = run(model, inputs, head, False, monkeypatch)
    packed_logits, packed_grads, packed = run(model, inputs, head, True, monkeypatch)
    real = padded.sequence_mask.bool()
    assert real.float().mean() < 1  # the batch has padding to skip
    torch.testing.assert_close(packed.sequence[real], padded.sequence[real], atol=1e-5, rtol=1e-5)
    assert packed.sequence[~real].abs().max() == 0  # no layer ran on the padding
    if head == "refer":  # scores of padded regions are masked in both; only the real ones mean anything
        keep = inputs.region_mask.bool()
        packed_logits, padded_logits = packed_logits[keep], padded_logits[keep]
    torch.testing.assert_close(packed_logits, padded_logits, atol=1e-5, rtol=1e-5)
    assert packed_grads.keys() == padded_grads.keys()
    for name in padded_grads:
        torch.testing.assert_close(packed_grads[name], padded_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_attention_probabilities_are_those_of_the_padded_batch(make_model, make_batch, monkeypatch):
    """The grounding analysis reads them: (B, heads, S, S) either way, equal at every real query."""
    model = make_model("visualbert", "vqa").eval()
    inputs = make_batch(model.config.encoder, batch=3, seed=1)
    args = (inputs.input_ids, inputs.attention_mask, inputs.token_type_ids, inputs.region_features,
            inputs.region_boxes, inputs.region_mask)
    with torch.no_grad():
        monkeypatch.setattr(Packing, "worthwhile", PADDED)
        padded = model.encoder(*args, output_attentions=True)
        monkeypatch.setattr(Packing, "worthwhile", staticmethod(lambda mask: True))
        packed = model.encoder(*args, output_attentions=True)
    real = padded.sequence_mask.bool()
    for a, b in zip(packed.attentions, padded.attentions):
        assert a.shape == b.shape
        torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.trace's deprecation: it is how export traced here
def test_packing_is_worthwhile_only_on_a_padded_batch_outside_export():
    mostly_real = torch.ones(4, 10)
    mostly_real[0, -1] = 0  # 39 of 40 slots real: the gathers would cost more than they skip
    half = torch.ones(4, 10)
    half[:, 5:] = 0
    assert not Packing.worthwhile(torch.ones(4, 10))
    assert not Packing.worthwhile(mostly_real)
    assert Packing.worthwhile(half)
    p = Packing(half)
    x = torch.randn(4, 10, 6)
    flat = p.pack(x)
    assert flat.shape == (20, 6) and torch.equal(flat, x[:, :5].reshape(20, 6))
    back = p.unpack(flat)
    assert torch.equal(back[:, :5], x[:, :5]) and back[:, 5:].abs().max() == 0
    # traced for export, a batch is never packed (its packed shapes would be baked into the graph)
    seen = []
    torch.jit.trace(lambda m: (seen.append(Packing.worthwhile(m)), m * 2)[1], (half,), check_trace=False)
    assert seen == [False]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("head,pool,expected", [("itm", "pooled", True), ("itm", "regions", False),
                                                ("vqa", "pooled", True), ("vqa", "regions", False),
                                                ("nlvr2", "pooled", True), ("multiple_choice", "pooled", True)])
def test_a_pooled_head_gets_the_full_passes_logits_and_gradients(head, pool, expected, packed, make_model, make_batch,
                                                                 monkeypatch):
    """A head that reads only the pooled vector runs the last layer for the first token alone: the same logits and
    the same gradients as the whole pass, packed or not."""
    model = make_model("u-visualbert", head, options={"pool": pool}, dropout=0.0, attention_dropout=0.0).train()
    assert model.heads[head].pooled_only is expected
    monkeypatch.setattr(Packing, "worthwhile", staticmethod(lambda mask: packed))
    inputs = make_batch(model.config.encoder, head=head, batch=4, seed=5)
    calls = []
    layer_forward = type(model.encoder.layer[-1]).forward
    monkeypatch.setattr(type(model.encoder.layer[-1]), "forward",
                        lambda self, *a, first_only=False, **k: (first_only and calls.append(1))
                        or layer_forward(self, *a, first_only=first_only, **k))

    def logits_and_grads(whole: bool):
        model.zero_grad(set_to_none=True)
        if whole:  # the whole last layer, then the head
            prepared = model.heads[head].prepare(inputs)
            out = model.heads[head].unprepare(model.forward_head(head, model.forward_features(prepared), prepared), inputs)
        else:
            out = model(inputs, head).logits
        out.pow(2).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, whole_grads = logits_and_grads(True)
    assert not calls
    fast, fast_grads = logits_and_grads(False)
    assert bool(calls) is expected
    torch.testing.assert_close(fast, whole, atol=1e-5, rtol=1e-5)
    assert fast_grads.keys() == whole_grads.keys()
    for name in whole_grads:
        torch.testing.assert_close(fast_grads[name], whole_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_attention_maps_and_two_stream_encoders_get_the_whole_pass(make_model, make_batch):
    model = make_model("visualbert", "itm").eval()
    inputs = make_batch(model.config.encoder, batch=2)
    with torch.no_grad():
        out = model(inputs, "itm", output_attentions=True)
    assert out.encoder.sequence is not None and len(out.encoder.attentions) == model.config.encoder.num_layers
    lxmert = make_model("lxmert", "itm").eval()
    with torch.no_grad():
        enc = lxmert(make_batch(lxmert.config.encoder, batch=2), "itm").encoder
    assert enc.text is not None and enc.image is not None  # no pooled_only pass there: it has no single last layer
