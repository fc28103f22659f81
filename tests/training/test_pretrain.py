"""Pretraining: every preset runs its paper objectives end to end, resume reproduces the loss curve and refuses another
run's state, weak mode never pairs text with images, bad configs and a diverging run fail with one message."""
import dataclasses
import math
import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import training.pretrain as pretrain_module
from models import PRESETS
from models.checkpoint import load_checkpoint
from models.detector import DetectorConfig, RegionDetector
from models.detector.io import load_detector, save_detector
from models.tokenizer import VLTokenizer
from training.data.region_table import RegionTable
from training.data.vl_tasks import Example
from training.finetune import STATE, detector_fingerprint
from training.objectives import IGNORE, grounded_token_ids
from training.pretrain import (
    DEFAULT_OBJECTIVES, BatchBuilder, PretrainConfig, PretrainConfigError, pretrain, pretraining_heads,
)
from training.vl_data import TaskData
from vlserve.cli import app

CLASSES = ["circle", "rectangle", "triangle"]
COLORS = ["red", "blue", "green", "gray"]
ANSWERS = [*CLASSES, *COLORS]


def synthetic_data(images: int = 16, regions: int = 5, dim: int = 16, seed: int = 0) -> TaskData:
    """Region rows whose features carry their class (mrc is learnable), captions, questions and ITM eval pairs."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(regions) < rng.integers(2, regions + 1, images)[:, None]).astype(np.int64)  # (M, N)
    obj_ids = np.where(mask == 1, rng.integers(0, len(CLASSES), mask.shape), -1)
    features = (np.eye(dim)[obj_ids.clip(min=0)] + 0.1 * rng.normal(size=(images, regions, dim))) * mask[..., None]
    lo = rng.uniform(0, 0.5, (images, regions, 2))
    boxes = (np.concatenate([lo, lo + rng.uniform(0.1, 0.5, lo.shape)], -1) * mask[..., None]).astype(np.float32)
    table = RegionTable(features.astype(np.float16), boxes, boxes * 64, mask, obj_ids, features.mean(1).astype(np.float16))
    color = [COLORS[i % len(COLORS)] for i in range(images)]
    captions = [Example((i,), f"a {color[i]} {CLASSES[obj_ids[i, 0]]} and a {CLASSES[obj_ids[i, 1]]}", 1) for i in range(images)]
    negatives = [Example(((i + 1) % images,), e.text, 0) for i, e in enumerate(captions)]
    questions = [Example((i,), f"what shape is the {color[i]} object?", ANSWERS.index(CLASSES[obj_ids[i, 0]])) for i in range(images)]
    return TaskData(table, table, {"itm": captions + negatives, "vqa": questions}, {"itm": captions + negatives},
                    ANSWERS, CLASSES, ["red"], "synthetic", dim)


@pytest.fixture(scope="module")
def detector_dir(tmp_path_factory):
    """An untrained detector of the synthetic classes (no region is ever extracted with it)."""
    path = tmp_path_factory.mktemp("pretrain") / "detector"
    torch.manual_seed(0)
    save_detector(RegionDetector(DetectorConfig(classes=CLASSES, attributes=["red"], num_boxes=5, feature_dim=16)), path)
    return path


@pytest.fixture(scope="module")
def data():
    return synthetic_data()


def tiny(out, detector, **kw) -> PretrainConfig:
    base = dict(out=out, detector_dir=detector, size="tiny", init_text=False, steps=6, batch_size=8, lr=2e-3,
                head_lr=2e-3, warmup=2, eval_examples=16, log_every=3, threads=1)
    return PretrainConfig(**{**base, **kw})


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_pretrains_its_paper_objectives_and_saves_a_checkpoint(preset, detector_dir, data, tmp_path):
    cfg = tiny(tmp_path / "enc", detector_dir, preset=preset)
    assert cfg.objectives == DEFAULT_OBJECTIVES[preset]
    result = pretrain(cfg, data=data, progress=False)
    heads = set(pretraining_heads(cfg.objectives, len(CLASSES), len(ANSWERS)))
    assert len(result["losses"]) == 6 and all(math.isfinite(x) for x in result["losses"])
    assert set().union(*result["records"]) == heads | {"total"}  # every objective got a loss
    ckpt = load_checkpoint(tmp_path / "enc", preset=preset)
    assert set(ckpt.model.heads) == heads
    assert ckpt.labels["heads"] == {t: names for t, names in (("mrc", CLASSES), ("image_qa", ANSWERS)) if t in heads}
    assert ckpt.manifest["training"]["config"]["objectives"] == list(cfg.objectives)
    assert ("itm_acc" in result["final"]) == ("itm" in heads)  # zero-shot retrieval reads the itm head
    # masked LM of the words the image decides, with each caption's own image and with another one
    grounded = {k: v for k, v in result["final"].items() if k.startswith("mlm_grounded")}
    assert set(grounded) == (set() if preset == "u-visualbert" else {"mlm_grounded_acc", "mlm_grounded_acc_other_image"})
    assert all(0.0 <= v <= 1.0 for v in grounded.values())
    assert not (tmp_path / "enc" / "train_state.pt").exists()


@pytest.mark.parametrize("preset", ["lxmert", "u-visualbert"])
def test_resume_reproduces_the_uninterrupted_loss_curve(preset, detector_dir, data, tmp_path):
    straight = pretrain(tiny(tmp_path / "a", detector_dir, preset=preset, steps=8), data=data, progress=False)["records"]
    cfg = tiny(tmp_path / "b", detector_dir, preset=preset, steps=8)
    first = pretrain(cfg, data=data, progress=False, stop_after=3)
    assert first["interrupted_at"] == 3 and (tmp_path / "b" / "train_state.pt").exists()
    resumed = pretrain(cfg, data=data, progress=False)["records"]
    assert [r.keys() for r in resumed] == [r.keys() for r in straight]
    for a, b in zip(resumed, straight):
        assert a == pytest.approx(b, abs=1e-5)


def test_a_state_another_run_wrote_or_a_torn_one_is_refused_before_the_data_work(detector_dir, data, tmp_path,
                                                                                  monkeypatch):
    cfg = tiny(tmp_path / "enc", detector_dir, preset="lxmert", steps=8)
    pretrain(cfg, data=data, progress=False, stop_after=3)
    state = tmp_path / "enc" / STATE
    saved = state.read_bytes()
    monkeypatch.setattr(pretrain_module, "prepare_task_data", lambda *a, **k: pytest.fail("the run prepared its data"))
    with pytest.raises(PretrainConfigError, match=re.escape(f"{state} is from another run (--preset 'lxmert', not "
                                                            f"'vl-bert'; --objectives ['mlm', 'mrfr', 'mrc', 'itm', "
                                                            f"'image_qa'], not ['mlm', 'mrc']): delete it")):
        pretrain(tiny(tmp_path / "enc", detector_dir, preset="vl-bert", steps=8), progress=False)
    other_detector = tmp_path / "other_detector"  # another detector of the same feature dim
    detector, _ = load_detector(detector_dir)
    with torch.no_grad():
        next(detector.parameters()).add_(1.0)
    save_detector(detector, other_detector)
    for changes, why in [(dict(mask_prob=0.3), f"--mask-prob {cfg.mask_prob!r}, not 0.3"),
                         (dict(seed=cfg.seed + 1), f"--seed {cfg.seed}, not {cfg.seed + 1}"),
                         (dict(detector_dir=other_detector), f"--detector {detector_fingerprint(detector_dir)!r}, not "
                                                             f"{detector_fingerprint(other_detector)!r}")]:
        with pytest.raises(PretrainConfigError, match=re.escape(f"{state} is from another run ({why}): delete it")):
            pretrain(dataclasses.replace(cfg, **changes), progress=False)
    state.write_bytes(saved[: len(saved) // 2])
    torn = f"{state} cannot be read: it is torn, or not a training state"
    with pytest.raises(PretrainConfigError, match=re.escape(torn)):
        pretrain(cfg, progress=False)
    state.write_bytes(saved)
    monkeypatch.undo()
    assert len(pretrain(cfg, data=data, progress=False)["losses"]) == 8


def test_cli_a_diverging_run_exits_2_with_one_line_and_writes_no_checkpoint(detector_dir, data, tmp_path, monkeypatch):
    monkeypatch.setattr(pretrain_module, "prepare_task_data", lambda *a, **k: data)  # no shapes-world extraction
    out = tmp_path / "enc"
    result = CliRunner().invoke(app, ["train", "pretrain", "--out", str(out), "--detector", str(detector_dir),
                                      "--preset", "vl-bert", "--size", "tiny", "--no-init-text", "--steps", "6",
                                      "--batch-size", "4", "--threads", "1", "--lr", "1e30", "--head-lr", "1e30"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, errors
    assert re.search(r"^error: training diverged at step \d+: the loss is (nan|inf) \(\w+ batch\); no checkpoint written",
                     errors[0]), errors
    assert list(out.iterdir()) == []


def test_weak_batches_are_never_paired_and_reconstruct_tags(detector_dir, data, tmp_path):
    tokenizer = VLTokenizer.pretrained_minilm()
    # one word per region's tag (the vlserve embedding style; the published one: test_u_visualbert_preset.py)
    builder = BatchBuilder(tiny(tmp_path, detector_dir, preset="u-visualbert", embedding_style="vlserve"), data, tokenizer)
    words = torch.from_numpy(tokenizer.tag_words(CLASSES))
    rng = np.random.default_rng(0)
    kinds = []
    for step in range(6):
        batch = builder(step, rng)
        kinds.append(batch.kind)
        inputs = batch.inputs
        if batch.kind == "text":  # no image: one padding region, no tag, only the text objective
            assert set(batch.targets) == {"mlm"} and not inputs.region_mask.any() and (inputs.tag_ids == -1).all()
            assert (inputs.attention_mask.sum(1) > 2).all()
        else:  # no text: [CLS] [SEP] only, image objectives only
            assert batch.kind == "image" and set(batch.targets) == {"mrc", "tag"}
            assert (inputs.input_ids == torch.tensor([tokenizer.cls_id, tokenizer.sep_id])).all()
            tags, classes = batch.targets["tag"], batch.targets["mrc"]
            chosen = tags != IGNORE
            assert chosen.any(-1).all() and torch.equal(chosen, classes != IGNORE)  # same regions, every row
            assert torch.equal(tags[chosen], words[classes[chosen]])  # tags are the class names' word ids
            assert (inputs.tag_ids[chosen] == tokenizer.mask_id).all()  # masked tags are hidden from the model
            assert (inputs.region_features[chosen] == 0).all()
            assert torch.isin(inputs.tag_ids[inputs.region_mask.bool() & ~chosen], words).all()  # the other tags anchor
    assert kinds == ["text", "image"] * 3


def test_paired_batches_swap_images_with_their_labels(detector_dir, data, tmp_path):
    """LXMERT: mismatched pairs carry the other image's region labels; vilbert's mrc targets are distributions."""
    tokenizer = VLTokenizer.pretrained_minilm()
    builder = BatchBuilder(tiny(tmp_path, detector_dir, preset="lxmert", batch_size=16), data, tokenizer)
    rng, matched = np.random.default_rng(0), []
    for step in range(4):
        batch = builder(step, rng)
        assert batch.kind == "paired" and {"mlm", "mrfr", "mrc", "itm"} <= set(batch.targets)
        mrfr, mrc = batch.targets["mrfr"], batch.targets["mrc"]
        chosen = mrfr["mask"]
        assert torch.equal(chosen, mrc != IGNORE) and batch.inputs.image_feature is None
        assert torch.equal(mrfr["features"][chosen].argmax(-1), mrc[chosen])  # labels follow the image actually shown
        matched.append(batch.targets["itm"])
        if "image_qa" in batch.targets:  # questions asked of another image have no right answer
            assert not batch.targets["image_qa"][batch.targets["itm"] == 0].any()
    assert 0.25 < torch.cat(matched).float().mean() < 0.75
    vilbert = BatchBuilder(tiny(tmp_path, detector_dir, preset="vilbert"), data, tokenizer)(0, np.random.default_rng(0))
    dist = vilbert.targets["mrc"]
    assert dist.shape[-1] == len(CLASSES) and torch.allclose(dist.sum(-1)[dist.sum(-1) > 0], torch.tensor(1.0))


def test_grounded_masked_lm_targets_detector_words_of_matched_pairs_only(detector_dir, data, tmp_path):
    tokenizer = VLTokenizer.pretrained_minilm()
    cfg = tiny(tmp_path, detector_dir, preset="visualbert", batch_size=16, mask_prob=0.5, mlm_words="grounded",
               mlm_matched_only=True)
    builder = BatchBuilder(cfg, data, tokenizer)
    grounded = grounded_token_ids(tokenizer, CLASSES + ["red"])
    rng, labelled = np.random.default_rng(0), 0
    for step in range(4):
        batch = builder(step, rng)
        labels, matched = batch.targets["mlm"], batch.targets["itm"].bool()
        chosen = labels != IGNORE
        assert torch.isin(labels[chosen], grounded).all()  # only class and attribute words are targets
        assert not chosen[~matched].any()  # a mismatched pair's words are not decided by its image
        assert chosen[matched].any(-1).all()  # every matched caption names a class: at least one target each
        labelled += int(chosen.sum())
    assert labelled > 0
    plain = BatchBuilder(tiny(tmp_path, detector_dir, preset="visualbert", batch_size=16), data, tokenizer)(0, np.random.default_rng(0))
    chosen = plain.targets["mlm"] != IGNORE
    assert not torch.isin(plain.targets["mlm"][chosen], grounded).all()  # by default every word is a target
    assert chosen[plain.targets["itm"] == 0].any()


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(preset="resnet"), "unknown preset 'resnet'"),
        (dict(mlm_words="nouns"), "unknown mlm_words 'nouns'"),
        (dict(preset="u-visualbert", mlm_words="grounded"), "mlm_words 'grounded' needs the mlm objective on paired"),
        (dict(preset="vl-bert", mlm_matched_only=True), "mlm_matched_only needs both the mlm and the itm objective"),
        (dict(size="huge"), "unknown size 'huge'"),
        (dict(objectives=("mlm", "mim")), "unknown objective 'mim'"),
        (dict(preset="lxmert", objectives=("weak",)), "objective 'weak' is not supported by preset 'lxmert'"),
        (dict(preset="vilbert", objectives=("mlm", "tag")), "objective 'tag' is not supported by preset 'vilbert'"),
        (dict(preset="u-visualbert", objectives=("weak", "itm")), "cannot be combined with itm"),
        (dict(objectives=("mrc", "mrc_kl")), "not both"),
        (dict(visual_feat_dim=2048), "feature dim mismatch: visual_feat_dim=2048"),
        (dict(init_text=True), "--init-text needs size small"),
        (dict(detector_dir="nowhere"), "detector directory not found"),
        (dict(preset="vl-bert", box_embedding="normalized"), "box_embedding 'normalized' is u-visualbert's"),
        (dict(device="tpu"), "device 'tpu' unknown: choose cpu, cuda or cuda:N"),
        (dict(device="cuda:7"), "device 'cuda:7': torch sees"),
        (dict(num_layers=0), "num_layers must be at least 1, got 0"),
    ],
)
def test_bad_configs_fail_before_training(changes, message, detector_dir, data, tmp_path):
    with pytest.raises(PretrainConfigError, match=re.escape(message)) as info:
        pretrain(tiny(tmp_path / "out", detector_dir, **changes), data=data, progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "bad_data, message",
    [
        (synthetic_data(dim=12), "feature dim mismatch: the region features are 12-d but the detector"),
        (TaskData(**{**synthetic_data().__dict__, "train": {"vqa": []}}), "missing data: no captions"),
    ],
)
def test_data_that_does_not_fit_fails_before_training(bad_data, message, detector_dir, tmp_path):
    with pytest.raises(PretrainConfigError, match=re.escape(message)):
        pretrain(tiny(tmp_path / "out", detector_dir, preset="lxmert"), data=bad_data, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "resnet"], "unknown preset 'resnet'"),
        (["--preset", "visualbert", "--objectives", "mlm,weak"], "objective 'weak' is not supported by preset 'visualbert'"),
        (["--visual-feat-dim", "2048"], "feature dim mismatch"),
        (["--mlm-words", "nouns"], "unknown mlm_words 'nouns'"),
        (["--preset", "vl-bert", "--mlm-matched-only"], "mlm_matched_only needs both the mlm and the itm objective"),
        (["--device", "gpu"], "device 'gpu' unknown"),
    ],
)
def test_cli_bad_configs_exit_2_with_one_message(args, message, detector_dir, tmp_path):
    result = CliRunner().invoke(app, ["train", "pretrain", "--out", str(tmp_path / "x"), "--detector", str(detector_dir), *args])
    assert result.exit_code == 2 and f"error: {message}" in result.stderr, result.output
    assert not (tmp_path / "x").exists()


def test_cli_missing_detector_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["train", "pretrain", "--out", str(tmp_path / "x"), "--detector", str(tmp_path / "none")])
    assert result.exit_code == 2 and "detector directory not found" in result.stderr


def test_cli_pretrains(detector_dir, data, tmp_path, monkeypatch):
    monkeypatch.setattr(pretrain_module, "prepare_task_data", lambda *a, **k: data)  # no shapes-world extraction
    result = CliRunner().invoke(app, ["train", "pretrain", "--out", str(tmp_path / "enc"), "--detector", str(detector_dir),
                                      "--preset", "vl-bert", "--size", "tiny", "--no-init-text", "--steps", "2",
                                      "--batch-size", "4", "--threads", "1", "--num-layers", "1"])
    assert result.exit_code == 0, result.output
    ckpt = load_checkpoint(tmp_path / "enc")
    assert set(ckpt.model.heads) == {"mlm", "mrc"}
    # --num-layers: the depth the fine-tuning continues (tiny's own is 2)
    assert ckpt.model.config.encoder.num_layers == 1 and len(ckpt.model.encoder.layer) == 1


def test_grounded_words_are_also_scored_with_another_scenes_image():
    """A scene's captions are consecutive: the image a caption is scored against must be another scene's."""
    rows = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    other = pretrain_module.other_scenes(rows)
    assert (other != rows).all() and set(other) <= set(rows)
    assert pretrain_module.other_scenes(np.array([4, 4, 4])) is None  # one image: nothing to compare with


def test_a_max_length_that_leaves_no_room_for_the_text_exits_2(detector_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(pretrain_module, "prepare_task_data", lambda *a, **k: pytest.fail("the run prepared its data"))
    result = CliRunner().invoke(app, ["train", "pretrain", "--out", str(tmp_path / "x"), "--detector", str(detector_dir),
                                      "--preset", "vl-bert", "--size", "tiny", "--no-init-text", "--max-length", "2"])
    assert result.exit_code == 2, result.output
    assert result.stderr == "error: max_length=2 leaves no room for the text: at least 3 tokens ([CLS], a word, [SEP])\n"
