"""Every registered preset x every head kind at the tiny size: shapes, losses, gradients, padding, attention."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models import HEAD_KINDS, PRESETS, VLInputs, create_model
from models.layers import TransformerLayer


def expected_shape(model, kind: str, inputs: VLInputs) -> tuple[int, ...]:
    enc, head = model.config.encoder, model.config.heads[kind]
    batch, text_len, regions = inputs.input_ids.shape[0], inputs.input_ids.shape[-1], inputs.region_mask.shape[-1]
    choices = inputs.input_ids.shape[1] if inputs.input_ids.dim() == 3 else 0
    phrases = 0 if inputs.phrase_index is None else inputs.phrase_index.shape[1]
    shapes = {
        "vqa": (batch, head.num_labels), "image_qa": (batch, head.num_labels), "nlvr2": (batch, 2),
        "itm": (batch, 2), "refer": (batch, regions), "multiple_choice": (batch, choices),
        "grounding": (batch, phrases, regions), "mlm": (batch, text_len, enc.vocab_size),
        "tag": (batch, regions, enc.vocab_size), "mrfr": (batch, regions, enc.visual_feat_dim),
        "mrc": (batch, regions, head.num_labels),
    }
    assert kind in shapes, f"head kind {kind!r} is new: state its logits shape here"
    return shapes[kind]


def first_params(encoder: nn.Module) -> dict[str, nn.Parameter]:
    """The input embeddings of every stream and the first transformer layer of every stream."""
    params = {}
    for name, child in encoder.named_children():
        if isinstance(child, nn.ModuleList):
            if len(child) and isinstance(child[0], TransformerLayer):
                params.update({f"{name}.0.{n}": p for n, p in child[0].named_parameters()})
        elif "pooler" not in name:
            params.update({f"{name}.{n}": p for n, p in child.named_parameters()})
    return params


@pytest.mark.parametrize("kind", HEAD_KINDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_head_on_preset(preset, kind, make_model, make_batch, make_labels):
    model = make_model(preset, kind).train()
    inputs = make_batch(model.config.encoder, head=kind)

    out = model(inputs, kind)
    assert out.logits.shape == expected_shape(model, kind, inputs)
    assert out.loss is None

    out = model(inputs, kind, labels=make_labels(model.config.heads[kind], model.config.encoder, inputs))
    assert out.loss is not None and out.loss.dim() == 0 and torch.isfinite(out.loss)
    out.loss.backward()

    no_grad = [n for n, p in first_params(model.encoder).items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, f"no gradient reaches {no_grad}"
    head = dict(model.heads[kind].named_parameters())
    assert head and all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.values())
    # biases can be exactly shift-invariant under a softmax (refer, multiple choice); weight matrices are not
    flat = [n for n, p in head.items() if p.dim() > 1 and not p.grad.abs().sum() > 0]
    assert not flat, f"head weights without gradient: {flat}"


def pad(inputs: VLInputs, tokens: int, regions: int, seed: int = 7) -> VLInputs:
    """Append `tokens` padded text positions (random word ids) and `regions` padded regions (random features and
    boxes), all with mask 0."""
    g = torch.Generator().manual_seed(seed)

    def extend(t: torch.Tensor | None, extra: int, axis: int, fill=None) -> torch.Tensor | None:
        if t is None or extra == 0:
            return t
        shape = list(t.shape)
        shape[axis] = extra
        if fill is not None:
            tail = torch.full(shape, fill, dtype=t.dtype)
        elif t.is_floating_point():
            tail = torch.randn(shape, generator=g, dtype=t.dtype)
        else:
            tail = torch.randint(1000, 2000, shape, generator=g, dtype=t.dtype)
        return torch.cat([t, tail], dim=axis)

    boxes = extend(inputs.region_boxes, regions, -2)
    if regions:
        boxes[..., -regions:, :] = boxes[..., -regions:, :].sigmoid().sort(-1).values  # still valid x1 < x2 boxes
    return inputs.replace(
        input_ids=extend(inputs.input_ids, tokens, -1),
        attention_mask=extend(inputs.attention_mask, tokens, -1, fill=0),
        token_type_ids=extend(inputs.token_type_ids, tokens, -1, fill=0),
        region_features=extend(inputs.region_features, regions, -2),
        region_boxes=boxes,
        region_mask=extend(inputs.region_mask, regions, -1, fill=0),
        tag_ids=extend(inputs.tag_ids, regions, -1),
    )


def real_logits(kind: str, logits: torch.Tensor, inputs: VLInputs) -> torch.Tensor:
    """The logits of the real tokens / regions of `inputs` (flattened); `logits` may come from a padded copy."""
    t, n = inputs.input_ids.shape[-1], inputs.region_mask.shape[-1]
    text, regions = inputs.attention_mask.bool(), inputs.region_mask.bool()
    if kind == "mlm":  # (B, T, V)
        return logits[:, :t][text]
    if kind == "tag":  # (B, N, V): a region without a tag has no tag token to score in u-visualbert's published embeddings
        return logits[:, :n][regions & (inputs.tag_ids >= 0)]
    if kind in ("refer", "mrfr", "mrc"):  # (B, N, ...)
        return logits[:, :n][regions]
    if kind == "grounding":  # (B, P, N)
        return logits[..., :n].masked_select(regions[:, None, :])
    return logits  # one row per example (or per candidate)


@pytest.mark.parametrize("tokens,regions", [(3, 0), (0, 4), (3, 4)], ids=["text", "regions", "both"])
@pytest.mark.parametrize("preset", PRESETS)
def test_padding_is_inert(preset, tokens, regions, make_model, make_batch):
    model = make_model(preset, *HEAD_KINDS).eval()
    inputs = make_batch(model.config.encoder)
    t, n = inputs.input_ids.shape[-1], inputs.region_mask.shape[-1]
    text, real_regions = inputs.attention_mask.bool(), inputs.region_mask.bool()
    with torch.no_grad():
        ref, out = model.forward_features(inputs), model.forward_features(pad(inputs, tokens, regions))
        torch.testing.assert_close(out.pooled, ref.pooled, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.text[:, :t][text], ref.text[text], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.image[:, :n][real_regions], ref.image[real_regions], atol=1e-5, rtol=0)
        for kind in HEAD_KINDS:
            batch = make_batch(model.config.encoder, head=kind)
            expected = real_logits(kind, model(batch, kind).logits, batch)
            got = real_logits(kind, model(pad(batch, tokens, regions), kind).logits, batch)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=lambda m: f"head {kind}: {m}")


@pytest.mark.parametrize("preset", PRESETS)
def test_attention_probabilities(preset, make_model, make_batch):
    model = make_model(preset).eval()
    inputs = make_batch(model.config.encoder)
    with torch.no_grad():
        fast = model.forward_features(inputs)
        slow = model.forward_features(inputs, output_attentions=True)
    assert fast.attentions is None and fast.cross_attentions is None
    for name in ("text", "image", "pooled"):  # SDPA path == explicit softmax path
        torch.testing.assert_close(getattr(slow, name), getattr(fast, name), atol=1e-5, rtol=0)

    enc = model.config.encoder
    b, t = inputs.input_ids.shape
    assert slow.attentions and len(slow.attentions) == enc.num_layers
    key_mask = inputs.attention_mask if slow.sequence_mask is None else slow.sequence_mask  # (B, S)
    for probs in slow.attentions:  # (B, heads, S, S)
        assert probs.shape == (b, enc.num_heads, key_mask.shape[1], key_mask.shape[1])
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-5, rtol=0)
        assert probs.masked_select(key_mask[:, None, None, :] == 0).abs().max() < 1e-6  # padded keys get nothing

    if not enc.is_two_stream:
        assert slow.cross_attentions is None
        return
    assert len(slow.cross_attentions) == enc.num_cross_layers
    for probs in slow.cross_attentions:  # (B, heads, T, N): text attending to regions
        assert probs.shape[0] == b and probs.shape[2:] == (t, inputs.region_mask.shape[1])
        assert probs.masked_select(inputs.region_mask[:, None, None, :] == 0).abs().max() < 1e-6
        total = probs.sum(-1)
        if preset == "vilbert":  # the leading whole-image [IMG] key is left out, so the regions' share is below 1
            assert ((total > 0) & (total <= 1 + 1e-5)).all()
        else:
            torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", PRESETS)
def test_same_seed_same_init(preset, make_model):
    a, b, c = make_model(preset, "vqa", seed=3), make_model(preset, "vqa", seed=3), make_model(preset, "vqa", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: create_model("bert", "tiny"), "unknown preset 'bert'"),
        (lambda: create_model("visualbert", "huge"), "unknown size 'huge'"),
        (lambda: create_model("visualbert", "tiny", heads={"x": {"kind": "captioning"}}), "unknown head kind 'captioning'"),
        (lambda: create_model("visualbert", "tiny", heads={"vqa": {"kind": "vqa"}}), "head vqa needs num_labels > 0"),
        (lambda: create_model("lxmert", "tiny", hidden_size=30), r"hidden_size=30 is not a multiple of its number of heads \(4\)"),
        (lambda: create_model("vilbert", "tiny", image_hidden_size=50), "image_hidden_size=50 is not a multiple"),
        (lambda: create_model("vilbert", "tiny", coattention_text_layers=(1,)), "one coattention_text_layers index per co-attention layer"),
        (lambda: create_model("vilbert", "tiny", coattention_text_layers=(2, 1)), "non-decreasing"),
        (lambda: create_model("vilbert", "tiny", coattention_text_layers=(1, 3)), "0 to num_layers"),
        (lambda: create_model("vilbert", "tiny", coattention_text_layers=(-1, 1)), "0 to num_layers"),
        (lambda: create_model("vilbert", "tiny", coattention_image_layers=(-1, 1)), "0 to num_image_layers"),
    ],
    ids=["preset", "size", "head-kind", "vqa-num-labels", "heads", "image-heads", "coattention-count",
         "coattention-order", "coattention-range", "coattention-negative", "coattention-image-negative"],
)
def test_bad_config_is_a_clear_value_error(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_u_visualbert_sums_several_tag_words_per_region(make_model, make_batch):
    """tag_ids (B, N) and (B, N, 1) are the same input; a (B, N, T) slot of -1 adds nothing; a second real word
    per region (e.g. an attribute beside the class) adds its word embedding to that region only."""
    model = make_model("u-visualbert", "vqa", embedding_style="vlserve").eval()  # tags summed into their regions
    inputs = make_batch(model.config.encoder)
    tags = inputs.tag_ids
    assert tags is not None and tags.dim() == 2
    with torch.no_grad():
        flat = model(inputs, "vqa").logits
        one = model(inputs.replace(tag_ids=tags.unsqueeze(-1)), "vqa").logits
        padded = model(inputs.replace(tag_ids=torch.stack([tags, torch.full_like(tags, -1)], -1)), "vqa").logits
        emb = model.encoder.embeddings
        two = torch.stack([tags, torch.full_like(tags, 2000)], -1)
        vis_one = emb.visual(inputs.region_features, inputs.region_boxes, None, tags)
        vis_two = emb.visual(inputs.region_features, inputs.region_boxes, None, two)
    torch.testing.assert_close(one, flat)
    torch.testing.assert_close(padded, flat)
    torch.testing.assert_close(vis_two - vis_one, emb.word_embeddings.weight[2000].expand_as(vis_one))


def test_vl_bert_lets_the_image_in_through_layer_norms_that_start_at_zero(make_batch, make_labels):
    """VL-BERT adds the image to the text tokens and to the regions through LayerNorms whose weights start at 0
    (visual_ln_text / visual_ln_object, visual_scale_*_init 0 in its configs): the untrained model does not yet
    depend on the image, so its pretrained text side is intact; the first step gives those weights a gradient,
    and after it the image reaches the output. Every other LayerNorm starts at 1."""
    from models import HeadConfig

    torch.manual_seed(0)
    model = create_model("vl-bert", "tiny", heads={"itm": HeadConfig(kind="itm")})
    emb = model.encoder.embeddings
    gates = (emb.visual_ln_text.weight, emb.visual_ln_object.weight)
    assert all(bool((w == 0).all()) for w in gates)
    assert bool((emb.LayerNorm.weight == 1).all())
    inputs = make_batch(model.config.encoder, head="itm")
    other = inputs.replace(region_features=inputs.region_features + torch.randn_like(inputs.region_features))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(other, "itm").logits, model(inputs, "itm").logits)
    loss = model(inputs, "itm", labels=make_labels(model.config.heads["itm"], model.config.encoder, inputs)).loss
    loss.backward()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in gates)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
        assert not torch.allclose(model(other, "itm").logits, model(inputs, "itm").logits)
