"""The detector's training RoIAlign: same outputs and feature gradients as torchvision's roi_align, same detector
losses, and torchvision's own op wherever no gradient is needed (inference, no_grad)."""
import numpy as np
import pytest
import torch
import torchvision.ops.poolers as tv_poolers
from torchvision.ops import MultiScaleRoIAlign
from torchvision.ops import roi_align as tv_roi_align

import models.detector.roi_align as ours
from models.detector import DetectorConfig, RegionDetector
from models.detector.roi_align import TrainingRoIAlign, roi_align

STRIDE = 8


def rois_for(n_images: int, fh: int, fw: int, g: torch.Generator, beyond: bool = True) -> torch.Tensor:
    """(K, 5) rows (image, x1, y1, x2, y2) in image pixels (feature size * STRIDE), images in shuffled order:
    random boxes, boxes on each border and corner, the whole image, tiny boxes (< 1 feature pixel, some at the
    corners), zero-size boxes and (beyond=True) boxes reaching past the image, where torchvision zeroes samples."""
    ih, iw = fh * STRIDE, fw * STRIDE
    xy = torch.rand(24, 2, generator=g) * torch.tensor([iw, ih])
    wh = torch.rand(24, 2, generator=g) * torch.tensor([iw, ih]) / 2
    boxes = [torch.cat([xy, torch.minimum(xy + wh, torch.tensor([iw, ih]))], 1)]
    boxes.append(torch.tensor([[0, 0, iw / 3, ih / 2], [iw / 2, 0, iw, ih / 4], [0, ih / 2, iw / 5, ih],
                               [iw * 0.6, ih * 0.7, iw, ih], [0, 0, iw, ih], [0, 5, iw, 9], [3, 0, 11, ih]]))
    tiny = torch.rand(8, 2, generator=g) * torch.tensor([iw - 4, ih - 4])
    boxes.append(torch.cat([tiny, tiny + 0.2 + torch.rand(8, 2, generator=g) * 5], 1))
    boxes.append(torch.tensor([[0, 0, 3, 2], [iw - 2, ih - 5, iw, ih], [iw - 1, 0, iw, 1], [0, ih - 3, 4, ih],
                               [10, 10, 10, 10], [iw, ih, iw, ih], [0, 0, 0, 0]]))
    if beyond:
        boxes.append(torch.tensor([[-30, -20, iw + 25, ih + 40], [-9, -9, 4, 4], [iw - 3, ih - 3, iw + 20, ih + 20],
                                   [-50, 5, -12, 30]]))
    boxes = torch.cat(boxes).float()
    image = torch.randint(0, n_images, (boxes.shape[0], 1), generator=g).float()
    return torch.cat([image, boxes], 1)


@pytest.mark.parametrize("aligned", [False, True])
def test_forward_and_feature_gradient_equal_torchvision(aligned):
    g = torch.Generator().manual_seed(0)
    for fh, fw in [(16, 16), (10, 13), (4, 4), (1, 3)]:
        feats = torch.randn(3, 8, fh, fw, generator=g, requires_grad=True)
        rois = rois_for(3, fh, fw, g)
        want = tv_roi_align(feats, rois, 7, 1 / STRIDE, 2, aligned)
        got = roi_align(feats, rois, 7, 1 / STRIDE, 2, aligned)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        upstream = torch.randn(want.shape, generator=g)
        (want_grad,) = torch.autograd.grad(want, feats, upstream)
        (got_grad,) = torch.autograd.grad(got, feats, upstream)
        # a pixel's gradient sums every RoI's share: float32 rounding grows with that sum (up to ~40 here), and is
        # mostly torchvision's (ours is 4-10x nearer the float64 gradient), so 1e-5 is relative to the largest
        scale = max(1.0, want_grad.abs().max().item())
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5 * scale, rtol=0)


def test_float64_is_exact_which_float32_rounding_would_hide():
    """In float64 both ops agree to rounding (~1e-15): the sample positions, bin sizes, the zeroing beyond
    [-1, size] and the clamping are torchvision's, not merely close to them."""
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 4, 12, 9, generator=g, dtype=torch.float64, requires_grad=True)
    rois = rois_for(2, 12, 9, g).double()
    for output_size, ratio in [(7, 2), ((3, 5), 3), (2, 1)]:
        want = tv_roi_align(feats, rois, output_size, 1 / STRIDE, ratio)
        got = roi_align(feats, rois, output_size, 1 / STRIDE, ratio)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
        upstream = torch.randn(want.shape, generator=g, dtype=torch.float64)
        torch.testing.assert_close(torch.autograd.grad(got, feats, upstream)[0],
                                   torch.autograd.grad(want, feats, upstream)[0], atol=1e-12, rtol=0)


def test_list_boxes_empty_rois_and_adaptive_sampling():
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2, 4, 8, 8, generator=g, requires_grad=True)
    per_image = [torch.tensor([[0.0, 0, 30, 20], [5, 5, 64, 64]]), torch.tensor([[1.0, 2, 3, 4]])]
    torch.testing.assert_close(roi_align(feats, per_image, 7, 1 / STRIDE, 2),
                               tv_roi_align(feats, per_image, 7, 1 / STRIDE, 2), atol=1e-5, rtol=0)
    empty = roi_align(feats, torch.zeros(0, 5), 7, 1 / STRIDE, 2)
    assert empty.shape == (0, 4, 7, 7)
    rois = rois_for(2, 8, 8, g)
    torch.testing.assert_close(roi_align(feats, rois, 7, 1 / STRIDE, 0),  # torchvision's op: per-RoI sample counts
                               tv_roi_align(feats, rois, 7, 1 / STRIDE, 0))


def pyramid(g: torch.Generator, n: int = 2, side: int = 512) -> dict[str, torch.Tensor]:
    return {str(i): torch.randn(n, 6, side // s, side // s, generator=g, requires_grad=True)
            for i, s in enumerate((8, 16, 32))}


def image_boxes(g: torch.Generator, count: int, side: int) -> torch.Tensor:
    """Boxes clipped to the image, from a few pixels to the whole image: all three FPN levels get some."""
    size = torch.exp(torch.rand(count, 2, generator=g) * np.log(side)) + torch.rand(count, 2, generator=g)
    x1y1 = torch.rand(count, 2, generator=g) * side
    boxes = torch.cat([x1y1, x1y1 + size], 1).clamp(0, side)
    return torch.cat([boxes, torch.tensor([[0.0, 0, side, side], [side - 0.5, 0, side, 0.7], [0, side - 3, 2, side]])])


def test_multiscale_pooler_equals_torchvision_on_every_level():
    g = torch.Generator().manual_seed(3)
    side = 512  # level 2 (stride 32) takes boxes of sqrt(area) >= 448 (canonical 224 px at level 4)
    feats = pyramid(g, side=side)
    boxes = [image_boxes(g, 60, side), image_boxes(g, 45, side)]
    shapes = [(side, side), (side - 40, side - 17)]
    reference, pooler = MultiScaleRoIAlign(["0", "1", "2"], 7, 2), TrainingRoIAlign(["0", "1", "2"], 7, 2)
    want, got = reference(feats, boxes, shapes), pooler(feats, boxes, shapes)
    assert set(pooler.map_levels(boxes).tolist()) == {0, 1, 2}, "the boxes should reach every FPN level"
    assert pooler.scales == reference.scales == [1 / 8, 1 / 16, 1 / 32]
    exact_feats = {k: v.detach().double().requires_grad_() for k, v in feats.items()}
    exact = MultiScaleRoIAlign(["0", "1", "2"], 7, 2)(exact_feats, [b.double() for b in boxes], shapes)
    # torchvision's float32 sample positions on the 64 x 64 map are off by up to ulp(64) ~ 8e-6 px: its outputs
    # are ~1e-5 from the float64 answer, ours ~4e-7 (its float64 positions are cast once, to weights)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(got.double(), exact, atol=2e-6, rtol=0)
    upstream = torch.randn(want.shape, generator=g)
    levels = list(feats.values())
    for w, o, e in zip(torch.autograd.grad(want, levels, upstream), torch.autograd.grad(got, levels, upstream),
                       torch.autograd.grad(exact, list(exact_feats.values()), upstream.double())):
        scale = max(1.0, e.abs().max().item())
        assert e.abs().sum() > 0
        torch.testing.assert_close(o, w, atol=1e-5 * scale, rtol=0)
        torch.testing.assert_close(o.double(), e, atol=1e-6 * scale, rtol=0)

    # RoIs all on one level take a shortcut (no scatter into a zero tensor): the same numbers
    small = [b[(b[:, 2:] - b[:, :2]).prod(1) < 100**2] for b in boxes]
    large = [torch.tensor([[0.0, 0, 512, 512], [10, 20, 500, 480]]), torch.tensor([[0.0, 0, 472, 480]])]
    for level, some in [(0, small), (2, large)]:
        assert set(pooler.map_levels(some).tolist()) == {level}
        want, got = reference(feats, some, shapes), pooler(feats, some, shapes)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        up = upstream[: len(want)]
        torch.testing.assert_close(torch.autograd.grad(got, levels[level], up)[0],
                                   torch.autograd.grad(want, levels[level], up)[0], atol=1e-4, rtol=0)


class Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def spies(monkeypatch):
    """(torchvision's op as MultiScaleRoIAlign calls it, ours as TrainingRoIAlign calls it), counting calls."""
    theirs, mine = Spy(tv_poolers.roi_align), Spy(ours.roi_align)
    monkeypatch.setattr(tv_poolers, "roi_align", theirs)
    monkeypatch.setattr(ours, "roi_align", mine)
    return theirs, mine


def test_gradients_pick_our_op_and_everything_else_torchvision(spies):
    theirs, mine = spies
    g = torch.Generator().manual_seed(4)
    feats = pyramid(g, side=256)
    boxes, shapes = [image_boxes(g, 20, 256)], [(256, 256)]
    pooler = TrainingRoIAlign(["0", "1", "2"], 7, 2)
    pooler(feats, boxes, shapes)
    assert set(pooler.map_levels(boxes).tolist()) == {0, 1}
    assert mine.calls == 3 and theirs.calls == 0  # one call per level, as torchvision
    with torch.no_grad():
        pooler(feats, boxes, shapes)
    with torch.inference_mode():
        pooler(feats, boxes, shapes)
    pooler({k: v.detach() for k, v in feats.items()}, boxes, shapes)  # features without gradients
    assert mine.calls == 3 and theirs.calls == 9


CLASSES, ATTRS = ["circle", "rectangle", "triangle"], ["red", "blue", "small", "large"]


def tiny_detector(seed: int = 0) -> RegionDetector:
    torch.manual_seed(seed)
    cfg = DetectorConfig(classes=CLASSES, attributes=ATTRS, min_size=64, max_size=160, rpn_pre_nms_top_n=200,
                         rpn_post_nms_top_n=60, rpn_train_pre_nms_top_n=300, rpn_train_post_nms_top_n=100,
                         box_batch_size_per_image=64, num_boxes=12)
    return RegionDetector(cfg)  # the pretrained backbone: realistic feature magnitudes (random: ~1e-3)


def scenes(n: int) -> tuple[list[np.ndarray], list[dict]]:
    rng = np.random.default_rng(0)
    images, targets = [], []
    for i in range(n):
        h, w = (64, 64) if i % 2 == 0 else (96, 80)
        img = np.full((h, w, 3), 235, np.uint8)
        boxes = []
        for k in range(3):
            bw, bh = int(rng.integers(w // 6, w // 2)), int(rng.integers(h // 6, h // 2))
            x, y = int(rng.integers(0, w - bw + 1)), int(rng.integers(0, h - bh + 1))
            img[y : y + bh, x : x + bw] = rng.integers(0, 200, 3)
            boxes.append([x, y, x + bw, y + bh])
        boxes[0] = [0, 0, w // 3, h // 3]  # one object in the corner: proposals touching the image border
        targets.append({"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.tensor([0, 1, 2]),
                        "attributes": torch.tensor([[1.0, 0, 1, 0], [0, 1, 0, 1], [1.0, 0, 0, 1]])})
        images.append(img)
    return images, targets


def losses_and_grads(det: RegionDetector, images, targets):
    torch.manual_seed(7)  # the RPN's and box head's sampling of training examples
    losses = det.losses(images, targets)
    params = [p for p in det.parameters() if p.requires_grad]
    grads = torch.autograd.grad(sum(losses.values()), params, allow_unused=True)
    return {k: v.item() for k, v in losses.items()}, grads


def test_detector_training_losses_and_gradients_unchanged(spies):
    theirs, mine = spies
    det = tiny_detector().train()
    assert isinstance(det.roi_heads.box_roi_pool, TrainingRoIAlign)
    images, targets = scenes(4)
    new_losses, new_grads = losses_and_grads(det, images, targets)
    assert mine.calls == 1 and theirs.calls == 0  # boxes under 224 px (sqrt area) pool from level 0 only
    det.roi_heads.box_roi_pool = MultiScaleRoIAlign(["0", "1", "2"], det.config.roi_size, sampling_ratio=2)
    old_losses, old_grads = losses_and_grads(det, images, targets)
    assert theirs.calls == 3
    assert new_losses.keys() == old_losses.keys() and new_losses["loss_classifier"] > 0
    for k in old_losses:
        assert new_losses[k] == pytest.approx(old_losses[k], abs=1e-5), k
    for new, old in zip(new_grads, old_grads):  # every weight's gradient, the backbone's through RoIAlign included
        if old is not None:
            torch.testing.assert_close(new, old, atol=1e-5, rtol=1e-4)


def test_inference_uses_torchvision_and_checkpoints_are_interchangeable(spies):
    theirs, mine = spies
    det = tiny_detector().eval()
    images, _ = scenes(2)
    det.extract(images)
    assert theirs.calls > 0 and mine.calls == 0
    # no parameters or buffers: the state_dict is the one a torchvision MultiScaleRoIAlign detector has
    assert det.roi_heads.box_roi_pool.state_dict() == {}
    plain = tiny_detector(seed=1)
    plain.roi_heads.box_roi_pool = MultiScaleRoIAlign(["0", "1", "2"], det.config.roi_size, sampling_ratio=2)
    assert list(plain.state_dict()) == list(det.state_dict())
    det.load_state_dict(plain.state_dict(), strict=True)
    plain.eval()
    a, b = det.extract(images), plain.extract(images)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.features, y.features)
