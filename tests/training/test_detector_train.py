"""`vlserve train detector` end to end at a tiny size: trains, saves a loadable detector, scores it on the val split;
a diverging run stops with one message and saves nothing."""
import json
import math

import pytest
import torch

from models.detector.io import load_detector
from training.data.shapes_cache import ShapesConfig
from training.data.shapes_world import WorldConfig
from training.detector_train import DetectorTrainConfig, train_detector
from training.finetune import TrainingError

SMALL = ShapesConfig(world=WorldConfig(seed=3, height=64, width=64), splits=(("train", 8), ("val", 6)))
TINY = {"min_size": 64, "max_size": 64, "rpn_pre_nms_top_n": 50, "rpn_post_nms_top_n": 20, "num_boxes": 4}


def test_a_short_run_saves_a_detector_scored_on_the_asked_number_of_val_images(tmp_path, monkeypatch):
    import models.checkpoint

    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    swapped_in, swap = [], models.checkpoint._swap_in
    # the metrics come in with the detector, never after it: a build killed between the two found a detector without
    # the metrics its model card reads, and failed at every later attempt
    monkeypatch.setattr(models.checkpoint, "_swap_in", lambda staging, out: (
        swapped_in.append(sorted(p.name for p in staging.iterdir())), swap(staging, out)))
    out = tmp_path / "det"
    metrics = train_detector(DetectorTrainConfig(out=out, steps=2, batch_size=2, warmup=1, eval_every=1, eval_images=2,
                                                 final_eval_images=4, threads=1, data=SMALL, detector=TINY), progress=False)
    assert [h["images"] for h in metrics["history"]] == [2]  # the periodic evaluation at step 1
    assert metrics["val"]["images"] == 4 and 0.0 <= metrics["val"]["map50"] <= 1.0
    assert json.loads((out / "metrics.json").read_text())["fingerprint"] == metrics["fingerprint"]
    assert "metrics.json" in swapped_in[0] and "manifest.json" in swapped_in[0]
    detector, fingerprint = load_detector(out)
    assert fingerprint == metrics["fingerprint"] and detector.config.num_boxes == 4
    # without a limit the whole val split is scored
    whole = train_detector(DetectorTrainConfig(out=tmp_path / "det2", steps=1, batch_size=2, warmup=1, eval_every=10,
                                               threads=1, data=SMALL, detector=TINY), progress=False)
    assert whole["val"]["images"] == 6 and whole["history"] == []


def test_the_attribute_loss_weight_scales_the_attribute_gradient_only(tmp_path, monkeypatch):
    """attribute_weight multiplies the colour/size loss: at 0 the attribute head learns nothing, at 1 it does."""
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    heads = {}
    for w in (0.0, 1.0):
        train_detector(DetectorTrainConfig(out=tmp_path / f"det{w}", steps=2, batch_size=2, warmup=1, eval_every=10,
                                           final_eval_images=2, threads=1, data=SMALL, detector=TINY, attribute_weight=w),
                       progress=False)
        heads[w] = load_detector(tmp_path / f"det{w}")[0].attr_score.weight.detach().clone()
    import torch

    from models.detector import DetectorConfig, RegionDetector
    from training.detector_train import ATTRIBUTES
    from training.data.shapes_world import SHAPES

    torch.manual_seed(0)  # the start both runs share
    start = RegionDetector(DetectorConfig(classes=list(SHAPES), attributes=list(ATTRIBUTES), **TINY)).attr_score.weight
    assert not torch.equal(heads[1.0], start)
    # weight decay alone moves it at 0: SGD's decay is tiny (1e-4 x lr), the loss's gradient is not
    assert (heads[0.0] - start).abs().max() < 1e-5 < (heads[1.0] - start).abs().max()
    import pytest

    with pytest.raises(ValueError, match="attribute_weight=-1 must be 0 or more"):
        train_detector(DetectorTrainConfig(out=tmp_path / "bad", attribute_weight=-1.0, data=SMALL, detector=TINY),
                       progress=False)


def test_a_run_whose_loss_diverges_stops_at_that_step_and_saves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    cfg = DetectorTrainConfig(out=tmp_path / "det", steps=4, batch_size=2, warmup=1, lr=1e30, eval_every=10,
                              final_eval_images=2, threads=1, data=SMALL, detector=TINY)
    with pytest.raises(TrainingError, match=r"^training diverged at step \d+: the loss is (nan|inf); no checkpoint "
                                            r"written \(try a lower learning rate\)$"):
        train_detector(cfg, progress=False)
    assert not (tmp_path / "det").exists()


@pytest.mark.parametrize("steps, eval_every", [(2, 1), (1, 10)])  # the periodic evaluation after step 1, the final one
def test_weights_a_step_leaves_non_finite_are_never_evaluated_or_saved(tmp_path, monkeypatch, steps, eval_every):
    """The step's loss was finite, its update left a NaN weight: the run stops before the next evaluation (periodic or
    final) would feed it NaN region features."""
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    sgd = torch.optim.SGD

    class Poisoning(sgd):
        def step(self, closure=None):
            super().step(closure)
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = math.nan

    monkeypatch.setattr(torch.optim, "SGD", Poisoning)
    cfg = DetectorTrainConfig(out=tmp_path / "det", steps=steps, batch_size=2, warmup=1, eval_every=eval_every,
                              eval_images=2, final_eval_images=2, threads=1, data=SMALL, detector=TINY)
    with pytest.raises(TrainingError, match=r"^training diverged at step 1: the weights are not finite"):
        train_detector(cfg, progress=False)
    assert not (tmp_path / "det").exists()


def test_a_val_split_smaller_than_eval_images_is_scored_whole(tmp_path, monkeypatch):
    """--val-scenes under the periodic evaluation's 200 images: it scores the whole split, not images that are not."""
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    metrics = train_detector(DetectorTrainConfig(out=tmp_path / "det", steps=2, batch_size=2, warmup=1, eval_every=1,
                                                 eval_images=200, final_eval_images=4, threads=1, data=SMALL,
                                                 detector=TINY), progress=False)
    assert [h["images"] for h in metrics["history"]] == [6]


def test_a_save_over_a_finished_detector_that_fails_leaves_it_whole(tmp_path, monkeypatch):
    """The detector is written beside --out and swapped in: a save that stops leaves the finished one loadable."""
    import training.detector_train as detector_train

    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    cfg = DetectorTrainConfig(out=tmp_path / "det", steps=1, batch_size=2, warmup=1, eval_every=10, final_eval_images=2,
                              threads=1, data=SMALL, detector=TINY)
    fingerprint = train_detector(cfg, progress=False)["fingerprint"]
    save = detector_train.save_detector

    def killed(detector, out, extra=None):
        save(detector, out, extra)
        (out / "manifest.json").unlink()  # as a kill just before the manifest
        raise KeyboardInterrupt

    monkeypatch.setattr(detector_train, "save_detector", killed)
    with pytest.raises(KeyboardInterrupt):
        train_detector(cfg.__class__(**{**cfg.__dict__, "seed": 1}), progress=False)
    assert load_detector(tmp_path / "det")[1] == fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "det"]
