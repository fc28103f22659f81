"""Region detector: output contract, batched = per-image extraction, training lowers the loss, checkpoints."""
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from models.checkpoint import CheckpointError
from models.detector import DetectorConfig, RegionDetector
from models.detector.io import load_detector, save_detector
from models.detector.select import choose_regions, region_confidence

CLASSES, ATTRS = ["circle", "rectangle", "triangle"], ["red", "blue", "small", "large"]


def small_config(**kw) -> DetectorConfig:
    """Small images and few proposals keep the tests fast; the architecture is the real one."""
    base = dict(classes=CLASSES, attributes=ATTRS, min_size=64, max_size=160, rpn_pre_nms_top_n=200,
                rpn_post_nms_top_n=60, num_boxes=12)
    return DetectorConfig(**{**base, **kw})


def scene(h: int, w: int, seed: int) -> tuple[np.ndarray, dict]:
    """A pale image with two filled rectangles, and its targets."""
    rng = np.random.default_rng(seed)
    img = np.full((h, w, 3), 240, np.uint8)
    boxes = []
    for k in range(2):
        bw, bh = int(rng.integers(w // 6, w // 3)), int(rng.integers(h // 6, h // 3))
        x, y = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
        img[y : y + bh, x : x + bw] = (200, 30, 30) if k == 0 else (30, 30, 200)
        boxes.append([x, y, x + bw, y + bh])
    target = {"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.tensor([1, 1]),
              "attributes": torch.tensor([[1.0, 0, 0, 1], [0, 1, 0, 1]])}
    return img, target


@pytest.fixture(scope="module")
def detector():
    torch.manual_seed(0)
    return RegionDetector(small_config()).eval()


IMAGES = [scene(64, 64, 0)[0], scene(100, 150, 1)[0], scene(64, 64, 2)[0], scene(77, 41, 3)[0], scene(200, 120, 4)[0]]


def test_output_contract(detector):
    for img, rf in zip(IMAGES, detector.extract(IMAGES)):
        h, w = img.shape[:2]
        n = rf.num_boxes
        assert rf.boxes.shape == (12, 4) and rf.features.shape == (12, 512) and rf.image_hw == (h, w)
        assert 0 < n <= 12
        assert rf.image_feature.shape == (512,)
        real = rf.boxes[:n]
        assert (real[:, 0] >= 0).all() and (real[:, 1] >= 0).all() and (real[:, 2] <= w).all() and (real[:, 3] <= h).all()
        assert (real[:, 2] >= real[:, 0]).all() and (real[:, 3] >= real[:, 1]).all()
        assert np.all(np.diff(rf.obj_scores[:n]) <= 0), "regions come most confident first"
        assert ((rf.obj_ids[:n] >= 0) & (rf.obj_ids[:n] < len(CLASSES))).all()
        assert ((rf.attr_ids[:n] >= 0) & (rf.attr_ids[:n] < len(ATTRS))).all()
        assert (rf.obj_ids[n:] == -1).all() and not rf.features[n:].any() and not rf.boxes[n:].any()
        assert rf.region_mask().sum() == n


def test_batched_equals_per_image_on_mixed_sizes(detector):
    batched = detector.extract(IMAGES, batch_size=4)
    for img, b in zip(IMAGES, batched):
        alone = detector.extract([img])[0]
        assert alone.num_boxes == b.num_boxes
        np.testing.assert_allclose(b.features.astype(np.float32), alone.features.astype(np.float32), atol=1e-4)
        np.testing.assert_allclose(b.boxes, alone.boxes, atol=1e-3)
        np.testing.assert_array_equal(b.obj_ids, alone.obj_ids)


def test_adaptive_mode_keeps_between_min_and_max():
    torch.manual_seed(0)
    det = RegionDetector(small_config(adaptive=True, min_boxes=3, max_boxes=20, conf_thresh=0.5)).eval()
    for rf in det.extract(IMAGES[:2]):
        assert rf.boxes.shape[0] == 20 and 3 <= rf.num_boxes <= 20


def test_zero_proposals_give_an_image_without_regions(monkeypatch):
    """An RPN that proposes nothing (here: rpn_post_nms_top_n=0) is a valid answer: num_boxes 0, all padding."""
    torch.manual_seed(0)
    det = RegionDetector(small_config(rpn_post_nms_top_n=0), pretrained_backbone=False).eval()
    blank = np.full((64, 80, 3), 255, np.uint8)
    for img, rf in zip([blank, IMAGES[1]], det.extract([blank, IMAGES[1]])):
        assert rf.num_boxes == 0 and rf.boxes.shape == (12, 4) and rf.image_hw == img.shape[:2]
        assert not rf.boxes.any() and not rf.features.any() and (rf.obj_ids == -1).all()
        assert rf.image_feature.shape == (512,) and rf.region_mask().sum() == 0
        rf.validate()
    (dets,) = det.detect([blank])
    assert dets["boxes"].shape == (0, 4) and dets["scores"].numel() == 0

    # one image of a batch without proposals leaves the other image's regions as they are alone
    torch.manual_seed(0)
    det = RegionDetector(small_config(), pretrained_backbone=False).eval()
    alone = det.extract([IMAGES[0]])[0]
    propose = det.rpn.forward

    def none_for_the_first(images, features, targets=None):
        proposals, losses = propose(images, features, targets)
        return [proposals[0][:0], *proposals[1:]], losses

    monkeypatch.setattr(det.rpn, "forward", none_for_the_first)
    empty, same = det.extract([IMAGES[2], IMAGES[0]])  # both 64 x 64: one canvas, one batch
    assert empty.num_boxes == 0 and same.num_boxes == alone.num_boxes > 0
    np.testing.assert_allclose(same.features.astype(np.float32), alone.features.astype(np.float32), atol=1e-4)


def test_region_selection_functions():
    boxes = torch.tensor([[[0, 0, 10, 10.0]], [[0, 0, 10, 9.0]], [[20, 20, 30, 30.0]]])  # (R=3, K=1, 4)
    scores = torch.tensor([[0.9], [0.8], [0.3]])
    conf, cls = region_confidence(boxes, scores, 0.3)
    assert conf.tolist() == pytest.approx([0.9, 0.0, 0.3])  # the duplicate is suppressed
    assert cls.tolist() == [0, 0, 0]
    assert choose_regions(conf, 2, False, 1, 5, 0.5).tolist() == [0, 2]
    assert choose_regions(conf, 2, True, 1, 5, 0.5).tolist() == [0]  # only one above 0.5
    assert choose_regions(conf, 2, True, 2, 5, 0.95).tolist() == [0, 2]  # at least min_boxes


def test_a_few_training_steps_lower_the_loss():
    torch.manual_seed(0)
    det = RegionDetector(small_config())
    batch = [scene(64, 64, s) for s in range(4)]
    images, targets = [b[0] for b in batch], [b[1] for b in batch]
    opt = torch.optim.SGD([p for p in det.parameters() if p.requires_grad], lr=0.005, momentum=0.9)
    det.train()
    losses = []
    for _ in range(8):
        loss = sum(det.losses(images, targets).values())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(det.parameters(), 10.0)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_save_load_and_tampering(detector, tmp_path):
    fp = save_detector(detector, tmp_path / "det")
    loaded, fp2 = load_detector(tmp_path / "det")
    assert fp == fp2 and len(fp) == 16
    a, b = detector.extract(IMAGES[:1])[0], loaded.extract(IMAGES[:1])[0]
    np.testing.assert_array_equal(a.features, b.features)
    with open(tmp_path / "det" / "model.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(CheckpointError, match="model.safetensors does not match its sha256"):
        load_detector(tmp_path / "det")


def test_a_directory_whose_name_is_not_utf8_loads(detector, tmp_path):
    """safetensors takes UTF-8 paths only; a folder named in another encoding (Latin-1 "modèle") still loads."""
    out = Path(os.fsdecode(bytes(tmp_path) + b"/mod\xe8le"))
    fp = save_detector(detector, out)
    loaded, fp2 = load_detector(out)
    assert fp == fp2
    np.testing.assert_array_equal(detector.extract(IMAGES[:1])[0].features, loaded.extract(IMAGES[:1])[0].features)


def test_config_is_validated():
    with pytest.raises(ValueError, match="at least one object class"):
        DetectorConfig(classes=[])
    DetectorConfig(classes=["a"], min_boxes=0)  # read in adaptive mode only (frcnn-vg's MIN_DETECTIONS may be 0)
    with pytest.raises(ValueError, match="min_boxes must be a positive integer, not 0"):
        DetectorConfig(classes=["a"], min_boxes=0, adaptive=True)
    with pytest.raises(ValueError, match="0 < min_boxes <= max_boxes"):
        DetectorConfig(classes=["a"], min_boxes=20, max_boxes=10, adaptive=True)
    with pytest.raises(ValueError, match="unknown keys: colour"):
        DetectorConfig.from_dict({"classes": ["a"], "colour": 1})


@pytest.mark.parametrize("field,value,message", [
    ("classes", 3, "classes must be a list of names"),
    ("attributes", ["red", 7], "attributes must be a list of names"),
    ("min_size", "128", "min_size must be a positive integer, not '128'"),
    ("max_size", None, "max_size must be a positive integer, not None"),
    ("fpn_channels", 0, "fpn_channels must be a positive integer"),
    ("rpn_post_nms_top_n", -1, "rpn_post_nms_top_n must be an integer, 0 or more"),
    ("roi_size", 2.5, "roi_size must be a positive integer"),
    ("mean", [0.5], "mean must hold 3 finite numbers"),
    ("std", [0.0, 0.0, 0.0], "std must hold numbers above 0"),
    ("std", [0.2, 0.2], "std must hold 3 numbers"),
    ("aspect_ratios", [1.0, -2.0], "aspect_ratios must hold numbers above 0"),
    ("anchor_sizes", [[12, 24], [32, "48"], [64]], "anchor_sizes must hold, per feature level, numbers above 0"),
    ("rpn_nms_thresh", 1.5, "rpn_nms_thresh must be a number from 0 to 1"),
    ("adaptive", "yes", "adaptive must be true or false"),
    ("trainable_blocks", -1, "trainable_blocks must be an integer, 0 or more"),
    ("pixel_range", 0, "pixel_range must be a number above 0"),
])
def test_a_demo_family_config_that_cannot_run_is_refused_naming_its_field(tmp_path, detector, field, value, message):
    """Not a traceback from the model's constructor, nor a detector that loads and then fails on every image: the
    config is refused where it is read, by load_detector (info, extract, serve) as by DetectorConfig."""
    with pytest.raises(ValueError, match=re.escape(message)):
        DetectorConfig.from_dict({**small_config().to_dict(), field: value})
    out = tmp_path / "det"
    save_detector(detector, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, field: value}))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["config.json"] = hashlib.sha256((out / "config.json").read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_detector(out)
