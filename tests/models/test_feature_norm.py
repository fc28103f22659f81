"""Region-feature standardisation (FeatureNorm), the softmax VQA loss and bf16 autocast training."""
import numpy as np
import pytest
import torch

from models import HeadConfig, VLInputs, create_model
from models.checkpoint import load_checkpoint, save_checkpoint
from models.heads import soft_target_cross_entropy, vqa_soft_score_loss
from models.layers import FeatureNorm
from models.tokenizer import VLTokenizer

PRESETS = ["visualbert", "vl-bert", "u-visualbert", "vilbert", "lxmert"]


def inputs(d: int, scale: torch.Tensor | None = None, shift: float = 0.0) -> VLInputs:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 2000, (2, 5), generator=g)
    feats = torch.randn(2, 4, d, generator=g)
    if scale is not None:
        feats = feats * scale + shift
    return VLInputs(ids, torch.ones_like(ids), torch.zeros_like(ids), feats, torch.rand(2, 4, 4, generator=g).sort(-1).values,
                    torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))


def test_fit_uses_real_regions_only_and_matches_numpy():
    rng = np.random.default_rng(0)
    feats = rng.normal(3.0, [0.1, 10.0, 1.0], size=(50, 6, 3)).astype(np.float16)
    mask = (rng.random((50, 6)) < 0.7).astype(np.int64)
    feats[mask == 0] = 1e4  # padding must not count
    norm = FeatureNorm(3)
    norm.fit(feats, mask, chunk=7)  # chunks that do not divide the table
    real = feats[mask == 1].astype(np.float64)
    np.testing.assert_allclose(norm.mean.numpy(), real.mean(0), rtol=1e-5)
    np.testing.assert_allclose(norm.std.numpy(), real.std(0, ddof=1) + 1e-3, rtol=1e-4)
    out = norm(torch.from_numpy(real).float())
    np.testing.assert_allclose(out.mean(0).numpy(), 0.0, atol=1e-4)
    np.testing.assert_allclose(out.std(0).numpy(), real.std(0, ddof=1) / (real.std(0, ddof=1) + 1e-3), rtol=1e-4)


def test_fit_rejects_wrong_width_and_empty_tables():
    norm = FeatureNorm(4)
    with pytest.raises(ValueError, match="width 3"):
        norm.fit(np.zeros((2, 2, 3)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="at least 2 real regions"):
        norm.fit(np.zeros((2, 2, 4)), np.zeros((2, 2)))


@pytest.mark.parametrize("preset", PRESETS)
def test_encoder_sees_standardised_features(preset):
    """A model with fitted statistics on shifted, scaled features equals the same model without the norm on the
    standardised ones: the norm is applied once, to regions and whole-image feature alike, in every preset."""
    torch.manual_seed(0)
    d = 16
    scale, shift = torch.linspace(0.01, 20.0, d), 5.0
    with_norm = create_model(preset, "tiny", heads={"itm": HeadConfig(kind="itm")}, visual_feat_dim=d, feature_norm=True).eval()
    plain = create_model(preset, "tiny", heads={"itm": HeadConfig(kind="itm")}, visual_feat_dim=d).eval()
    plain.load_state_dict({k: v for k, v in with_norm.state_dict().items() if "feature_norm" not in k})
    with_norm.encoder.feature_norm.mean.fill_(shift)
    with_norm.encoder.feature_norm.std.copy_(scale)
    raw = inputs(d, scale, shift)
    standard = inputs(d)
    with torch.no_grad():
        torch.testing.assert_close(with_norm(raw, "itm").logits, plain(standard, "itm").logits, atol=1e-4, rtol=1e-4)


def test_statistics_travel_with_the_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = create_model("vl-bert", "tiny", heads={"itm": HeadConfig(kind="itm")}, visual_feat_dim=16, feature_norm=True)
    model.encoder.feature_norm.fit(np.random.default_rng(1).normal(2.0, 3.0, (8, 4, 16)), np.ones((8, 4)))
    save_checkpoint(model, tmp_path, VLTokenizer.pretrained_minilm(), labels={"heads": {}, "objects": [], "attributes": []})
    loaded = load_checkpoint(tmp_path).model
    assert loaded.config.encoder.feature_norm
    torch.testing.assert_close(loaded.encoder.feature_norm.mean, model.encoder.feature_norm.mean)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(inputs(16), "itm").logits, model.eval()(inputs(16), "itm").logits)


def test_vqa_ce_loss_is_softmax_cross_entropy_on_normalised_scores():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    scores = torch.tensor([[1.0, 0.0, 0.0], [0.6, 0.3, 0.0]])
    expected = torch.stack([
        -torch.log_softmax(logits[0], -1)[0],
        -(torch.log_softmax(logits[1], -1)[:2] * torch.tensor([2 / 3, 1 / 3])).sum(),
    ]).mean()
    torch.testing.assert_close(soft_target_cross_entropy(logits, scores), expected)
    head = create_model("visualbert", "tiny", heads={"vqa": HeadConfig(kind="vqa", num_labels=3, vqa_loss="ce")}, visual_feat_dim=16)
    bce = create_model("visualbert", "tiny", heads={"vqa": HeadConfig(kind="vqa", num_labels=3)}, visual_feat_dim=16)
    torch.testing.assert_close(head.heads["vqa"].loss(logits, scores, None), expected)
    torch.testing.assert_close(bce.heads["vqa"].loss(logits, scores, None), vqa_soft_score_loss(logits, scores))
    with pytest.raises(ValueError, match="vqa_loss"):
        HeadConfig(kind="vqa", num_labels=3, vqa_loss="mse")


def test_bf16_autocast_training_step_learns():
    from training.finetune import autocast

    torch.manual_seed(0)
    model = create_model("u-visualbert", "tiny", heads={"vqa": HeadConfig(kind="vqa", num_labels=3, vqa_loss="ce")}, visual_feat_dim=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, labels = inputs(16), torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    losses = []
    for _ in range(30):
        with autocast(True):
            loss = model(x, "vqa", labels).loss
        assert loss.dtype == torch.float32  # the loss leaves autocast in float32
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0]
