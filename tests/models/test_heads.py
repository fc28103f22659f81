"""Head losses against hand-computed values, and what each head promises beyond shapes (see test_presets.py)."""
from __future__ import annotations

import math

import pytest
import torch

from models import PRESETS
from models.heads import NEG, soft_target_cross_entropy, vqa_soft_score_loss


def test_soft_target_cross_entropy_by_hand():
    uniform = torch.zeros(1, 3)
    # two positives out of three equally likely classes: -(.5 ln 1/3 + .5 ln 1/3) = ln 3
    assert soft_target_cross_entropy(uniform, torch.tensor([[1.0, 1.0, 0.0]])).item() == pytest.approx(math.log(3))
    # softmax(ln 1, ln 2, ln 1) = (.25, .5, .25); targets are normalised, so 2 on the middle class is one-hot
    logits = torch.tensor([[0.0, math.log(2), 0.0]])
    assert soft_target_cross_entropy(logits, torch.tensor([[0.0, 2.0, 0.0]])).item() == pytest.approx(math.log(2))
    assert soft_target_cross_entropy(logits, torch.tensor([[1.0, 0.0, 1.0]])).item() == pytest.approx(math.log(4))


def test_soft_target_cross_entropy_skips_rows_without_a_positive():
    logits = torch.tensor([[0.0, math.log(2), 0.0], [5.0, -3.0, 1.0]])
    targets = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert soft_target_cross_entropy(logits, targets).item() == pytest.approx(math.log(2))
    logits.requires_grad_(True)
    none = soft_target_cross_entropy(logits, torch.zeros(2, 3))
    none.backward()
    assert none.item() == 0.0 and not logits.grad.any()  # zero, not NaN, and still differentiable


def test_vqa_soft_score_loss_by_hand():
    # BCE averaged over B x A entries, times A answers: the sum over answers, averaged over the batch
    assert vqa_soft_score_loss(torch.zeros(1, 2), torch.tensor([[1.0, 0.0]])).item() == pytest.approx(2 * math.log(2))
    sig = 1 / (1 + math.exp(-2.0))
    first = -(0.6 * math.log(sig) + 0.4 * math.log(1 - sig))  # logit 2, soft score .6
    second = -math.log(1 - 1 / (1 + math.exp(1.0)))  # logit -1, score 0
    got = vqa_soft_score_loss(torch.tensor([[2.0, -1.0]]), torch.tensor([[0.6, 0.0]]))
    assert got.item() == pytest.approx(first + second, rel=1e-6)
    batch = vqa_soft_score_loss(torch.tensor([[2.0, -1.0], [0.0, 0.0]]), torch.tensor([[0.6, 0.0], [1.0, 0.0]]))
    assert batch.item() == pytest.approx((first + second + 2 * math.log(2)) / 2, rel=1e-6)


@pytest.mark.parametrize("kind", ["mlm", "tag", "mrc", "mrfr"])
def test_nothing_masked_is_zero_loss_not_nan(kind, make_model, make_batch, make_labels):
    model = make_model("u-visualbert", kind)
    inputs = make_batch(model.config.encoder)
    labels = make_labels(model.config.heads[kind], model.config.encoder, inputs)
    if kind == "mrfr":
        labels["mask"].zero_()
    else:
        labels.fill_(-100)
    loss = model(inputs, kind, labels=labels).loss
    loss.backward()
    assert loss.item() == 0.0


@pytest.mark.parametrize(
    "kind,options",
    [("vqa", dict(pool="answer_slot")), ("vqa", dict(classifier="linear")), ("nlvr2", dict(nlvr2_mode="joint")),
     ("nlvr2", dict(classifier="linear")), ("mrc", dict(mrc_loss="kl")), ("itm", dict(pool="regions")),
     ("nlvr2", dict(pool="regions")), ("nlvr2", dict(pool="regions", nlvr2_mode="joint")),
     ("vqa", dict(pool="regions_film"))],
    ids=["vqa-answer-slot", "vqa-linear", "nlvr2-joint", "nlvr2-linear", "mrc-kl", "itm-regions", "nlvr2-regions",
         "nlvr2-joint-regions", "vqa-regions-film"],
)
@pytest.mark.parametrize("preset", PRESETS)
def test_head_options_on_every_preset(preset, kind, options, make_model, make_batch, make_labels):
    model = make_model(preset, kind, options=options)
    inputs = make_batch(model.config.encoder, head=kind)
    head = model.config.heads[kind]
    out = model(inputs, kind, labels=make_labels(head, model.config.encoder, inputs))
    regions = inputs.region_mask.shape[-1]
    assert out.logits.shape == {"vqa": (2, head.num_labels), "nlvr2": (2, 2), "itm": (2, 2),
                                "mrc": (2, regions, head.num_labels)}[kind]
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.encoder.embeddings.word_embeddings.weight.grad.abs().sum() > 0


def test_refer_ignores_padded_regions(make_model, make_batch):
    model = make_model("visualbert", "refer").eval()
    inputs = make_batch(model.config.encoder)
    pad = inputs.region_mask == 0
    assert pad.any()
    out = model(inputs, "refer")
    assert (out.logits[pad] == NEG).all() and (out.logits[~pad] > NEG).all()
    gold = torch.zeros_like(out.logits)
    gold[:, 0] = 1.0
    with_padding_marked = gold + pad.float()  # a target on a padded region must not count
    torch.testing.assert_close(model(inputs, "refer", labels=with_padding_marked).loss, model(inputs, "refer", labels=gold).loss)


def test_grounding_ignores_absent_phrases(make_model, make_batch, make_labels):
    model = make_model("visualbert", "grounding").eval()
    inputs = make_batch(model.config.encoder)
    assert (inputs.phrase_index == -1).any()
    labels = make_labels(model.config.heads["grounding"], model.config.encoder, inputs)
    with torch.no_grad():
        out = model(inputs, "grounding", labels=labels)
        present = inputs.phrase_index >= 0  # (B, P)
        expected = soft_target_cross_entropy(out.logits[present], labels[present])
        assert out.logits.masked_select(inputs.region_mask[:, None, :] == 0).eq(NEG).all()
    torch.testing.assert_close(out.loss, expected)


def test_multiple_choice_is_permutation_equivariant(make_model, make_batch):
    model = make_model("lxmert", "multiple_choice").eval()
    inputs = make_batch(model.config.encoder, head="multiple_choice")
    order = torch.tensor([2, 0, 1])
    permuted = inputs.replace(input_ids=inputs.input_ids[:, order], attention_mask=inputs.attention_mask[:, order],
                              token_type_ids=inputs.token_type_ids[:, order])
    with torch.no_grad():
        logits, logits_permuted = model(inputs, "multiple_choice").logits, model(permuted, "multiple_choice").logits
    torch.testing.assert_close(logits_permuted, logits[:, order], atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", ["vilbert", "vl-bert"])
def test_nlvr2_pair_is_two_passes_left_then_right(preset, make_model, make_batch):
    model = make_model(preset, "nlvr2").eval()
    inputs = make_batch(model.config.encoder, head="nlvr2", image_feature=True)

    def image(i: int):
        return inputs.replace(region_features=inputs.region_features[:, i], region_boxes=inputs.region_boxes[:, i],
                              region_mask=inputs.region_mask[:, i], tag_ids=inputs.tag_ids[:, i],
                              image_feature=inputs.image_feature[:, i])

    with torch.no_grad():
        left, right = model.forward_features(image(0)).pooled, model.forward_features(image(1)).pooled
        expected = model.heads["nlvr2"].cls(torch.cat([left, right], dim=-1))
        torch.testing.assert_close(model(inputs, "nlvr2").logits, expected, atol=1e-5, rtol=0)
        swapped = model.heads["nlvr2"].cls(torch.cat([right, left], dim=-1))
    assert not torch.allclose(swapped, expected)


def test_vqa_answer_slot_reads_the_token_before_the_last_sep(make_model, make_batch):
    model = make_model("vl-bert", "vqa", options=dict(pool="answer_slot")).eval()
    inputs = make_batch(model.config.encoder)
    slot = inputs.attention_mask.sum(1) - 2  # rows have different lengths
    assert slot.unique().numel() > 1
    with torch.no_grad():
        text = model.forward_features(inputs).text
        expected = model.heads["vqa"].cls(text[torch.arange(2), slot])
        torch.testing.assert_close(model(inputs, "vqa").logits, expected, atol=1e-6, rtol=0)


def test_masked_lm_decoder_is_the_word_table(make_model, make_batch):
    model = make_model("visualbert", "mlm", "tag").eval()
    assert not any("decoder" in k for k in model.state_dict() if k.startswith("heads."))  # stored once, as the embedding
    inputs = make_batch(model.config.encoder)
    with torch.no_grad():
        before = model(inputs, "tag").logits
        model.encoder.embeddings.word_embeddings.weight[5000] += 1.0  # a word no input uses
        after = model(inputs, "tag").logits
    changed = (after - before).abs().amax(dim=(0, 1)) > 0
    assert changed[5000] and changed.sum() == 1


def test_tag_head_on_a_wider_image_stream(make_model, make_batch):
    """ViLBERT's image stream (48 wide at tiny) is projected onto the 32-wide word table before decoding."""
    model = make_model("vilbert", "tag")
    enc = model.config.encoder
    assert enc.image_width != enc.hidden_size
    logits = model(make_batch(enc), "tag").logits
    assert logits.shape == (2, make_batch(enc).region_mask.shape[1], enc.vocab_size)


def test_unknown_task_names_the_heads(make_model, make_batch):
    model = make_model("visualbert", "vqa", "itm")
    with pytest.raises(KeyError, match="vqa, itm"):
        model(make_batch(model.config.encoder), "refer")


@pytest.mark.parametrize("preset", PRESETS)
def test_vqa_region_pooling_reads_real_regions_only(preset):
    """pool="regions": the answer also reads an attention pooling of the contextual regions; padding regions
    get no weight, so changing a padded region's features leaves every real example's answer unchanged."""
    from models import HeadConfig, VLInputs, create_model

    torch.manual_seed(0)
    model = create_model(preset, "tiny", heads={"vqa": HeadConfig(kind="vqa", num_labels=5, pool="regions")}, visual_feat_dim=8).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 2000, (2, 6), generator=g)
    feats, boxes = torch.randn(2, 4, 8, generator=g), torch.rand(2, 4, 4, generator=g).sort(-1).values
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    x = VLInputs(ids, torch.ones_like(ids), torch.zeros_like(ids), feats, boxes, mask)
    changed = feats.clone()
    changed[1, 2:] += 5.0
    with torch.no_grad():
        a = model(x, "vqa").logits
        b = model(VLInputs(ids, torch.ones_like(ids), torch.zeros_like(ids), changed, boxes, mask), "vqa").logits
        pooled_only = model.heads["vqa"].cls(torch.cat([model.forward_features(x).pooled, torch.zeros(2, model.config.encoder.image_width)], -1))
    assert a.shape == (2, 5)
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a, pooled_only)  # the region pooling does reach the answer
    with pytest.raises(ValueError, match="pool"):
        HeadConfig(kind="vqa", num_labels=5, pool="mean")


def test_located_boxes_read_out_the_boxes_of_the_attended_regions():
    """regions_film's located boxes: each of the K location queries reads out the expected box under its attention
    over the real regions (a padded region never counts)."""
    from models import HeadConfig
    from models.heads import GEOMETRY_QUERIES, located_boxes
    from models.outputs import EncoderOutput

    assert GEOMETRY_QUERIES == 4
    hv, p = 4, 3
    regions = torch.eye(hv)[None]  # (1, 4, 4): region n is the unit vector e_n
    boxes = torch.tensor([[[0.0, 0.0, 0.2, 0.2], [0.5, 0.1, 0.7, 0.3], [0.1, 0.6, 0.3, 0.9], [0.6, 0.6, 1.0, 1.0]]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the fourth region is padding
    where_query = torch.nn.Linear(p, GEOMETRY_QUERIES * hv)
    with torch.no_grad():
        where_query.weight.zero_()
        where_query.bias.copy_(60.0 * torch.eye(hv).flatten())  # query k = 60 e_k: it attends to region k
    enc = EncoderOutput(text=torch.zeros(1, 2, hv), image=regions, pooled=torch.randn(1, p))
    with torch.no_grad():
        out = located_boxes(where_query, enc, mask, boxes)
        moved = located_boxes(where_query, enc, mask, boxes + torch.tensor([0, 0, 0, 1.0])[None, :, None])
    assert out.shape == (1, GEOMETRY_QUERIES, 4)
    where = out[0]
    torch.testing.assert_close(where[:3], boxes[0, :3], atol=1e-6, rtol=0)  # queries 0-2 locate regions 0-2
    torch.testing.assert_close(where[3], boxes[0, :3].mean(0))  # query 3's region is padding: the real ones, evenly
    torch.testing.assert_close(moved, out)  # moving the padded region's box changes nothing
    with pytest.raises(ValueError, match="pool='regions_geometry' was removed"):
        HeadConfig(kind="vqa", num_labels=5, pool="regions_geometry")


def test_region_counts_sum_sigmoid_gates_over_the_real_regions():
    """regions_film's counts: each of the K count queries sums a sigmoid gate over the real regions (a padded region
    never counts) and is read as its value and as bumps at 0, 1, ..., COUNT_BINS - 1."""
    from models import HeadConfig
    from models.heads import COUNT_BINS, COUNT_QUERIES, count_bumps, region_counts
    from models.outputs import EncoderOutput

    assert COUNT_QUERIES == 4
    hv, p = 4, 3
    regions = torch.tensor([[[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0], [1.0, 0, 0, 0], [1.0, 0, 0, 0]]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # three "e_0" regions and one "e_1" are real, the last is padding
    count_query = torch.nn.Linear(p, COUNT_QUERIES * (hv + 1))
    queries = torch.zeros(COUNT_QUERIES, hv)
    queries[0, 0] = 200.0  # query 0 fires on e_0 regions
    queries[1, 1] = 200.0  # query 1 on e_1 regions
    bias = torch.tensor([-50.0, -50.0, 50.0, -50.0])  # query 2 fires on every region, query 3 on none
    with torch.no_grad():
        count_query.weight.zero_()
        count_query.bias.copy_(torch.cat([queries.flatten(), bias]))
    enc = EncoderOutput(text=torch.zeros(1, 2, hv), image=regions, pooled=torch.randn(1, p))
    with torch.no_grad():
        counts = region_counts(count_query, enc, mask)
    assert counts.shape == (1, COUNT_QUERIES)
    torch.testing.assert_close(counts[0], torch.tensor([3.0, 1.0, 4.0, 0.0]), atol=1e-4, rtol=0)
    bumps = count_bumps(counts)[0].reshape(COUNT_QUERIES, COUNT_BINS)
    assert bumps.argmax(-1).tolist() == [3, 1, 4, 0]  # each count's bump peaks at its value
    torch.testing.assert_close(bumps[0, [2, 3, 4]], torch.tensor([math.exp(-2.0), 1.0, math.exp(-2.0)]), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="pool='regions_count' was removed"):
        HeadConfig(kind="nlvr2", pool="regions_count")


def test_modulated_regions_put_the_question_on_counts_and_located_boxes():
    """pool="regions_film": the explicit features are the counts, their bumps, each located region's centre (from
    the image centre) and size, and the centre offsets of every pair of located regions; the head also reads their
    projection multiplied elementwise by a projection of the question."""
    from models import HeadConfig
    from models.heads import (
        COUNT_BINS, COUNT_QUERIES, EXPLICIT, GEOMETRY_QUERIES, MODULATED, PAIRS, explicit_features, with_attended_regions,
        with_modulated_regions,
    )
    from models.outputs import EncoderOutput

    counts = torch.tensor([[2.0, 0.0, 1.0, 3.0]])
    boxes = torch.tensor([[[0.0, 0.0, 0.2, 0.2], [0.6, 0.2, 1.0, 0.4], [0.4, 0.4, 0.6, 0.6], [0.0, 0.8, 0.4, 1.0]]])
    e = explicit_features(counts, boxes)
    assert e.shape == (1, EXPLICIT) and len(PAIRS) == 6
    assert EXPLICIT == COUNT_QUERIES * (1 + COUNT_BINS) + 4 * GEOMETRY_QUERIES + 2 * len(PAIRS)
    at = COUNT_QUERIES * (1 + COUNT_BINS)
    torch.testing.assert_close(e[0, :COUNT_QUERIES], counts[0])
    centres = e[0, at: at + 8].reshape(4, 2)
    torch.testing.assert_close(centres, torch.tensor([[-0.4, -0.4], [0.3, -0.2], [0.0, 0.0], [-0.3, 0.4]]))
    torch.testing.assert_close(e[0, at + 8: at + 16].reshape(4, 2), torch.tensor([[0.2, 0.2], [0.4, 0.2], [0.2, 0.2], [0.4, 0.2]]))
    offsets = e[0, at + 16:].reshape(len(PAIRS), 2)
    assert PAIRS[0] == (0, 1)  # region 0 is 0.7 left of and 0.2 above region 1
    torch.testing.assert_close(offsets[0], torch.tensor([-0.7, -0.2]))
    torch.testing.assert_close(offsets, torch.stack([centres[i] - centres[j] for i, j in PAIRS]))

    hv, p = 4, 3
    enc = EncoderOutput(text=torch.zeros(1, 2, hv), image=torch.randn(1, 5, hv), pooled=torch.randn(1, p))
    mask, region_boxes = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]]), torch.rand(1, 5, 4).sort(-1).values
    region_query, count_query = torch.nn.Linear(p, hv), torch.nn.Linear(p, COUNT_QUERIES * (hv + 1))
    where_query = torch.nn.Linear(p, GEOMETRY_QUERIES * hv)
    film = torch.nn.ModuleDict({"question": torch.nn.Linear(p, MODULATED), "features": torch.nn.Linear(EXPLICIT, MODULATED)})
    with torch.no_grad():
        out = with_modulated_regions(region_query, count_query, where_query, film, enc, mask, region_boxes)
        assert out.shape == (1, p + hv + EXPLICIT + MODULATED)
        torch.testing.assert_close(out[:, : p + hv], with_attended_regions(region_query, enc, mask))
        explicit = out[:, p + hv: p + hv + EXPLICIT]
        torch.testing.assert_close(out[:, p + hv + EXPLICIT:], film["question"](enc.pooled) * film["features"](explicit))
        film["question"].weight.zero_()
        film["question"].bias.zero_()
        silent = with_modulated_regions(region_query, count_query, where_query, film, enc, mask, region_boxes)
    assert (silent[:, p + hv + EXPLICIT:] == 0).all()  # no question, no modulated features
    with pytest.raises(ValueError, match="pool='regions_film' is for vqa, image_qa"):
        HeadConfig(kind="refer", pool="regions_film")


@pytest.mark.parametrize("kind", ["itm", "nlvr2"])
def test_itm_and_nlvr2_region_pooling_reads_real_regions_only(kind):
    """pool="regions" on the matching heads: padded regions get no weight, and the attended regions reach the logits."""
    from models import HeadConfig, VLInputs, create_model

    torch.manual_seed(0)
    model = create_model("u-visualbert", "tiny", heads={kind: HeadConfig(kind=kind, pool="regions")}, visual_feat_dim=8).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 2000, (2, 6), generator=g)
    lead = (2, 2) if kind == "nlvr2" else (2,)  # NLVR2: a pair of images per example
    feats, boxes = torch.randn(*lead, 4, 8, generator=g), torch.rand(*lead, 4, 4, generator=g).sort(-1).values
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # example 1 has 2 real regions (in each image)
    mask = mask[:, None].expand(2, 2, 4).contiguous() if kind == "nlvr2" else mask
    changed = feats.clone()
    changed[1, ..., 2:, :] += 5.0  # only padding of example 1 (both images for NLVR2)
    x = VLInputs(ids, torch.ones_like(ids), torch.zeros_like(ids), feats, boxes, mask)
    with torch.no_grad():
        a = model(x, kind).logits
        b = model(x.replace(region_features=changed), kind).logits
        head = model.heads[kind]
        weight = head.region_query.weight.clone()
        head.region_query.weight.zero_()  # uniform attention instead of the learned query
        uniform = model(x, kind).logits
        head.region_query.weight.copy_(weight)
    assert a.shape == (2, 2)
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a, uniform)  # the query decides which regions the head reads
    with pytest.raises(ValueError, match="pool='regions' is for"):
        HeadConfig(kind="refer", pool="regions")
    with pytest.raises(ValueError, match="pool='answer_slot' is for"):
        HeadConfig(kind="itm", pool="answer_slot")


@pytest.mark.parametrize("pool", ["regions", "regions_film"])
@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "lxmert"])  # LXMERT's cross-attention itself falls
def test_an_image_without_regions_reads_none_of_its_padding(preset, pool):  # back to the padding (test_objectives)
    """A row with every region masked (the detector found nothing) pools zero regions, not the mean of the padding's
    states, which depend on the rest of the batch (packed or not)."""
    from models import HeadConfig, VLInputs, create_model

    torch.manual_seed(0)
    model = create_model(preset, "tiny", heads={"vqa": HeadConfig(kind="vqa", num_labels=5, pool=pool)},
                         visual_feat_dim=8).eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1000, 2000, (1, 30), generator=g)
    boxes = torch.rand(1, 4, 4, generator=g).sort(-1).values
    empty = torch.zeros(1, 4, dtype=torch.long)
    answers = []
    for padding in (torch.zeros(1, 4, 8), torch.randn(1, 4, 8, generator=g) * 3):  # other padding features
        x = VLInputs(ids, torch.ones_like(ids), torch.zeros_like(ids), padding, boxes, empty)
        with torch.no_grad():
            answers.append(model(x, "vqa").logits)
    # beside a short text with regions: the batch is mostly padding, so single-stream encoders pack it (padding
    # states then zero), where the row alone (30 of 34 positions real) is computed padded
    short = torch.cat([ids[:, :3], torch.zeros(1, 27, dtype=torch.long)], 1)
    x = VLInputs(torch.cat([ids, short]), torch.cat([torch.ones_like(ids), (short != 0).long()]),
                 torch.zeros(2, 30, dtype=torch.long), torch.cat([torch.zeros(1, 4, 8), torch.randn(1, 4, 8, generator=g)]),
                 boxes.expand(2, 4, 4), torch.cat([empty, torch.ones_like(empty)]))
    with torch.no_grad():
        answers.append(model(x, "vqa").logits[:1])
    for other in answers[1:]:
        torch.testing.assert_close(answers[0], other, atol=1e-5, rtol=1e-5)
