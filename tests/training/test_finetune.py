"""Multi-task fine-tuning: a tiny end-to-end run learns, saves and loads; resume reproduces the loss curve and refuses
another run's state; a diverging run writes nothing; multiple choice; starting from a checkpoint."""
import collections
import json
import dataclasses
import math
import re
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import training.finetune as finetune_module
from models import HeadConfig
from models.checkpoint import CheckpointError, load_checkpoint
from models.detector import DetectorConfig, RegionDetector
from models.detector.io import save_detector
from models.layers import Linear, cpu_bf16_unavailable
from models.query_bank import QueryBank
from models.tokenizer import VLTokenizer
from training.data.shapes_cache import ShapesConfig, load_split
from training.data.shapes_tasks import (
    all_attribute_questions, related_attribute_questions, related_expressions, relation_questions,
)
from training.data.vl_tasks import Example, collate
from training.finetune import (
    detector_fingerprint,
    STATE, FinetuneConfig, TrainingError, build_model, eval_precision, gemm_precision, head_of, init_from_checkpoint,
    phase_weights, train, training_tasks,
)
from training.vl_data import prepare_task_data, tagged
from vlserve.cli import app
from vlserve.commands.train import validate_finetune

SHAPES = ShapesConfig(splits=(("train", 160), ("val", 80), ("test", 2)))


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    """Regions of 160 + 80 shapes scenes from a small (untrained-head) detector, cached under a temp root."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLSERVE_CACHE", str(root))
        torch.manual_seed(0)
        cfg = DetectorConfig(classes=["circle", "rectangle", "triangle"], attributes=["red"], min_size=64, max_size=128,
                             rpn_pre_nms_top_n=100, rpn_post_nms_top_n=30, num_boxes=8, feature_dim=16)
        save_detector(RegionDetector(cfg), root / "detector")
        data = prepare_task_data(root / "detector", 160, 80, easy_vqa=False, progress=False, data=SHAPES, ranking=True,
                                 question_sets=True)
        yield root / "detector", data


def tiny(out, detector, **kw) -> FinetuneConfig:
    base = dict(out=out, detector_dir=detector, preset="lxmert", size="tiny", init_text=False, tasks={"vqa": 1.0, "nlvr2": 1.0},
                batch_size=32, lr=2e-3, head_lr=3e-3, warmup=20, eval_every=10_000, threads=1)
    return FinetuneConfig(**{**base, **kw})


def test_tiny_run_trains_saves_loads_and_beats_chance(task_data, tmp_path):
    detector, data = task_data
    result = train(tiny(tmp_path / "enc", detector, steps=300), data=data, progress=False)
    majority = collections.Counter(e.label for e in data.eval["vqa"]).most_common(1)[0][1] / len(data.eval["vqa"])
    assert result["final"]["vqa_acc"] > majority + 0.03, (result["final"], majority)
    assert result["final"]["nlvr2_acc"] > 0.5
    ckpt = load_checkpoint(tmp_path / "enc")
    assert ckpt.labels["heads"]["vqa"] == data.answers
    assert ckpt.manifest["detector"]["fingerprint"] == data.fingerprint
    assert ckpt.manifest["training"]["final"] == result["final"]
    assert result["eval_precision"] == "fp32"  # a float32 run is evaluated in float32
    assert not (tmp_path / "enc" / "train_state.pt").exists()


def test_a_bf16_run_is_evaluated_as_the_service_serves_it(monkeypatch):
    """bf16 GEMMs where they are fast here (the service's `auto` precision), float32 elsewhere and for fp32 runs."""
    assert eval_precision(False) == "fp32"
    assert eval_precision(True) == ("bf16" if cpu_bf16_unavailable() is None else "fp32")
    monkeypatch.setattr("models.layers.PACK_CPU_WEIGHTS", False)  # no packed path: bf16 GEMMs would not run at all
    assert eval_precision(True) == "fp32"


def test_bf16_trains_in_float32_where_the_cpu_would_emulate_it(task_data, tmp_path, monkeypatch):
    """Emulated bf16 (AVX2-only CPUs) is several times slower than float32: such a run trains exactly as float32."""
    detector, data = task_data
    monkeypatch.setattr("training.finetune.cpu_has_native_bf16", lambda: False)
    fp32 = train(tiny(tmp_path / "fp32", detector, steps=4), data=data, progress=False)
    asked = train(tiny(tmp_path / "bf16", detector, steps=4, bf16=True), data=data, progress=False)
    assert asked["train_precision"] == fp32["train_precision"] == "fp32"
    assert asked["losses"] == fp32["losses"]
    monkeypatch.setattr("training.finetune.cpu_has_native_bf16", lambda: True)
    native = train(tiny(tmp_path / "native", detector, steps=4, bf16=True), data=data, progress=False)
    assert native["train_precision"] == "bf16" and native["losses"] != fp32["losses"]


def test_gemm_precision_sets_every_linear_inside_the_block_and_float32_after_it():
    model = build_model(FinetuneConfig(preset="u-visualbert", size="tiny", init_text=False), feature_dim=16, num_answers=5)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # set_cpu_gemm_dtype refuses bfloat16 elsewhere
    if bf16:
        with gemm_precision(model, "bf16"):
            assert {m.gemm_dtype for m in linears} == {torch.bfloat16}
        assert {m.gemm_dtype for m in linears} == {torch.float32}
    with pytest.raises(RuntimeError), gemm_precision(model, "bf16" if bf16 else "fp32"):
        raise RuntimeError("an evaluation that fails")
    assert {m.gemm_dtype for m in linears} == {torch.float32}  # reset even when the evaluation raised


def test_resume_reproduces_the_uninterrupted_loss_curve(task_data, tmp_path):
    detector, data = task_data
    every_task = {"vqa": 1.0, "refer": 1.0, "itm": 1.0, "nlvr2": 1.0, "multiple_choice": 1.0}
    straight = train(tiny(tmp_path / "a", detector, steps=12, tasks=every_task), data=data, progress=False)
    cfg = tiny(tmp_path / "b", detector, steps=12, tasks=every_task)
    first = train(cfg, data=data, progress=False, stop_after=5)
    assert first["interrupted_at"] == 5 and (tmp_path / "b" / "train_state.pt").exists()
    resumed = train(cfg, data=data, progress=False)
    assert resumed["losses"] == pytest.approx(straight["losses"], abs=1e-5)
    scored = {k for k in straight["final"] if not k.startswith(("vqa_acc_", "positions_acc_"))}
    assert scored == {"vqa_acc", "refer_acc", "itm_acc", "nlvr2_acc", "mc_acc", "positions_acc"}  # the data has position questions


def no_data_work(monkeypatch):
    """A run that gets as far as preparing its data fails the test."""
    monkeypatch.setattr(finetune_module, "run_data", lambda *a, **k: pytest.fail("the run prepared its data"))


def test_a_state_another_run_wrote_or_a_torn_one_is_refused_before_the_data_work(task_data, tmp_path, monkeypatch):
    """Another preset, task set, learning rate or step count than the state's run, or a torn file: one TrainingError
    naming the state and what to do; the state stays, and its own run still resumes from it."""
    detector, data = task_data
    cfg = tiny(tmp_path / "enc", detector, steps=8)
    train(cfg, data=data, progress=False, stop_after=3)
    state = tmp_path / "enc" / STATE
    saved = state.read_bytes()
    fix = ": delete it to start the run over, or resume with the options it was started with"
    no_data_work(monkeypatch)
    other_detector = tmp_path / "other_detector"  # the same detector's files under another fingerprint
    shutil.copytree(detector, other_detector)
    manifest = json.loads((other_detector / "manifest.json").read_text())
    manifest["files"]["config.json"] = "0" * 64
    (other_detector / "manifest.json").write_text(json.dumps(manifest))
    ours, theirs = detector_fingerprint(detector), detector_fingerprint(other_detector)
    for changes, why in [
        (dict(preset="visualbert"), "is from another run (--preset 'lxmert', not 'visualbert')"),
        (dict(tasks={"vqa": 1.0, "nlvr2": 1.0, "refer": 1.0}),
         "is from another run (--tasks {'vqa': 1.0, 'nlvr2': 1.0}, not {'vqa': 1.0, 'nlvr2': 1.0, 'refer': 1.0})"),
        (dict(tasks={"vqa": 1.0, "nlvr2": 3.0}),  # the same tasks, other weights
         "is from another run (--tasks {'vqa': 1.0, 'nlvr2': 1.0}, not {'vqa': 1.0, 'nlvr2': 3.0})"),
        (dict(lr=1e-5), "is from another run (--lr 0.002, not 1e-05)"),  # the state would bring its own back
        (dict(steps=2), "is from another run (--steps 8, not 2)"),  # past them, or on another schedule
        # another detector of the same feature dim, other data, batches, regularisation, seed or schedule
        (dict(detector_dir=other_detector), f"is from another run (--detector {ours!r}, not {theirs!r})"),
        (dict(train_scenes=cfg.train_scenes + 1), f"is from another run (--train-scenes {cfg.train_scenes}, not {cfg.train_scenes + 1})"),
        (dict(batch_size=cfg.batch_size + 1), f"is from another run (--batch-size {cfg.batch_size}, not {cfg.batch_size + 1})"),
        (dict(dropout=0.5), f"is from another run (--dropout {cfg.dropout!r}, not 0.5)"),
        (dict(seed=cfg.seed + 7), f"is from another run (--seed {cfg.seed}, not {cfg.seed + 7})"),
        (dict(warmup=cfg.warmup + 1), f"is from another run (--warmup {cfg.warmup}, not {cfg.warmup + 1})"),
        (dict(clip=cfg.clip + 1), f"is from another run (--clip {cfg.clip!r}, not {cfg.clip + 1!r})"),
        (dict(max_length=cfg.max_length + 1), f"is from another run (--max-length {cfg.max_length}, not {cfg.max_length + 1})"),
        (dict(easy_vqa=not cfg.easy_vqa), f"is from another run (--easy-vqa {cfg.easy_vqa}, not {not cfg.easy_vqa})"),
    ]:
        with pytest.raises(TrainingError, match=re.escape(f"{state} {why}{fix}")):
            train(dataclasses.replace(cfg, **changes), progress=False)
    state.write_bytes(saved[: len(saved) // 2])
    torn = f"{state} cannot be read: it is torn, or not a training state{fix}"
    with pytest.raises(TrainingError, match=re.escape(torn)):
        train(cfg, progress=False)
    state.write_bytes(saved)
    monkeypatch.undo()
    assert len(train(cfg, data=data, progress=False)["losses"]) == 8


def test_a_state_that_records_no_run_is_checked_by_its_step_and_its_tensors(task_data, tmp_path):
    """A state written before states recorded their run still resumes; past the run's steps, or of another model, it
    is refused as the others are."""
    detector, data = task_data
    cfg = tiny(tmp_path / "enc", detector, steps=8)
    train(cfg, data=data, progress=False, stop_after=3)
    state = tmp_path / "enc" / STATE
    unrecorded = torch.load(state, weights_only=True)
    del unrecorded["run"]
    torch.save(unrecorded, state)
    with pytest.raises(TrainingError, match=re.escape(f"{state} is at step 3, past steps=2: delete it")):
        train(dataclasses.replace(cfg, steps=2), data=data, progress=False)
    with pytest.raises(TrainingError, match=re.escape(f"{state} does not fit the run's model or optimizer: delete it")):
        train(dataclasses.replace(cfg, preset="visualbert"), data=data, progress=False)
    assert len(train(cfg, data=data, progress=False)["losses"]) == 8


def test_a_run_whose_loss_diverges_stops_at_that_step_and_writes_nothing(task_data, tmp_path):
    detector, data = task_data
    with pytest.raises(TrainingError, match=r"^training diverged at step \d+: the (vqa|nlvr2) loss is (nan|inf); no "
                                            r"checkpoint written \(try a lower learning rate\)$"):
        train(tiny(tmp_path / "enc", detector, steps=20, lr=1e30, head_lr=1e30), data=data, progress=False)
    assert list((tmp_path / "enc").iterdir()) == []


def test_cli_a_diverging_run_and_a_foreign_state_exit_2_with_one_line(task_data, tmp_path, monkeypatch):
    detector, data = task_data
    monkeypatch.setattr(finetune_module, "prepare_task_data", lambda *a, **k: data)  # no shapes-world extraction
    out = tmp_path / "enc"
    common = ["train", "finetune", "--out", str(out), "--detector", str(detector), "--preset", "lxmert", "--size",
              "tiny", "--no-init-text", "--tasks", "vqa:1,nlvr2:1", "--batch-size", "32", "--threads", "1"]
    result = CliRunner().invoke(app, [*common, "--steps", "20", "--lr", "1e30", "--head-lr", "1e30"])
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert errors[0].startswith("error: training diverged at step ") and list(out.iterdir()) == []
    train(tiny(out, detector, steps=4), data=data, progress=False, stop_after=2)  # an interrupted run's state
    result = CliRunner().invoke(app, [*common, "--steps", "4", "--preset", "visualbert"])
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert errors[0].startswith(f"error: {out / STATE} is from another run (--preset 'lxmert', not 'visualbert'")


def nan_from_step(monkeypatch, first: int) -> None:
    """From its `first` step on (1-based), each optimizer's update leaves a NaN in one weight: the loss of that step
    was finite."""
    make = finetune_module.adamw

    def adamw(groups, lr):
        opt, steps = make(groups, lr), []
        update = opt.step

        def step():
            update()
            steps.append(1)
            if len(steps) >= first:
                with torch.no_grad():
                    opt.param_groups[0]["params"][0].view(-1)[0] = math.nan

        opt.step = step
        return opt

    monkeypatch.setattr(finetune_module, "adamw", adamw)


def test_weights_a_step_leaves_non_finite_are_never_saved(task_data, tmp_path, monkeypatch):
    """A step's loss can be finite and its update still leave NaN weights: the run stops before it would save them,
    in a resumable state or in the checkpoint, and the state saved before stays."""
    detector, data = task_data
    cfg = tiny(tmp_path / "enc", detector, steps=8, checkpoint_every=1)
    train(cfg, data=data, progress=False, stop_after=2)
    nan_from_step(monkeypatch, 1)  # the resumed run's first step, the run's third
    state = tmp_path / "enc" / STATE
    message = (f"training diverged at step 3: the weights are not finite; no checkpoint written (try a lower learning "
               f"rate); {state} holds an earlier step (delete it to start over)")
    with pytest.raises(TrainingError, match=re.escape(message)):
        train(cfg, data=data, progress=False)
    kept = torch.load(state, weights_only=True)
    assert kept["step"] == 2 and all(t.isfinite().all() for t in kept["model"].values() if t.is_floating_point())
    assert [p.name for p in (tmp_path / "enc").iterdir()] == [STATE]
    monkeypatch.undo()
    nan_from_step(monkeypatch, 6)  # the last step's update: only the checkpoint would have held it
    with pytest.raises(TrainingError, match=re.escape("training diverged at step 6: the weights are not finite")):
        train(tiny(tmp_path / "last", detector, steps=6), data=data, progress=False)
    assert list((tmp_path / "last").iterdir()) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "resnet"], "unknown preset 'resnet'"),
        (["--size", "huge"], "unknown size 'huge'"),
        (["--tasks", "vqa:1,grounding:1"], "unknown task 'grounding' in --tasks; choose from vqa, refer, itm, nlvr2, "
                                           "multiple_choice, itm_rank, itm_rank_text, positions, positions_one_side, relations, attributes, "
                                           "related_attributes, related_refer"),
        (["--tasks", "vqa:0"], "task weights must be positive"),
        (["--tasks", "vqa:nan"], "task weights must be finite numbers above 0, got vqa:nan"),
        (["--tasks", "vqa:inf,itm:1"], "task weights must be finite numbers above 0, got vqa:inf, itm:1"),
        (["--tasks", ""], "tasks is empty: give at least one task:weight"),
        (["--size", "tiny"], "--init-text needs size small"),
        (["--vqa-loss", "mse"], "--vqa-loss must be bce or ce"),
        (["--vqa-pool", "mean"], "--vqa-pool must be pooled, answer_slot, answer_segment, regions or regions_film"),
        (["--itm-pool", "answer_slot"], "--itm-pool must be pooled or regions"),
        (["--nlvr2-pool", "mean"], "--nlvr2-pool must be pooled or regions"),
        (["--tasks", "itm_rank:1", "--rank-pool", "cls"], "--rank-pool must be pooled or regions"),
        (["--tasks", "vqa:1,itm:1", "--rank-pool", "pooled"], "--rank-pool names the ranking head's pool: add itm_rank"),
        (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
        (["--preset", "u-visualbert", "--box-embedding", "sinusoid"], "unknown box_embedding 'sinusoid'"),
        (["--box-embedding", "normalized"], "box_embedding 'normalized' is u-visualbert's; visualbert embeds boxes"),
        (["--preset", "u-visualbert", "--box-embedding", "normalized"], "box_embedding applies to the vlserve embedding style"),
        (["--embedding-style", "published"], "embedding_style 'published' is u-visualbert's"),
        (["--preset", "lxmert", "--region-tags"], "region_tags is u-visualbert's; lxmert has no detector-tag embedding"),
        (["--tasks", "vqa:1", "--retrieval-queries", "50"], "retrieval_queries needs a task that trains the itm or rank head"),
        (["--tasks", "vqa:1,itm:1", "--query-bank", "8"], "query_bank draws the listing captions of the itm_rank set"),
        (["--tasks", "itm_rank:1", "--query-bank", "8", "--query-bank-temperature", "0"], "query_bank_temperature=0 above 0"),
        (["--tasks", "itm_rank:1", "--retrieval-queries", "5", "--eval-scenes", "40", "--retrieval-pool", "41"],
         "retrieval_pool=41 must be None or from 2 to eval_scenes=40"),
        (["--tasks", "itm_rank:1", "--rank-hard", "5", "--rank-partial", "3"], "rank_hard=5 and rank_partial=3 must be 0 or"),
        (["--tasks", "itm_rank:1", "--train-scenes", "10", "--query-bank", "11"],
         "query_bank=11 needs as many distinct listing captions: train_scenes=10 have at most 10"),
        (["--max-length", "2"], "max_length=2 leaves no room for the text: the run's tasks need at least 3 tokens"),
        (["--max-length", "4", "--tasks", "multiple_choice:1"], "max_length=4 leaves no room for the text: the run's "
                                                                "tasks need at least 5 tokens"),
        (["--max-length", "4", "--tasks", "vqa:1", "--vqa-pool", "answer_segment"], "max_length=4 leaves no room"),
        (["--device", "tpu"], "device 'tpu' unknown: choose cpu, cuda or cuda:N"),
        (["--device", "cuda:7"], "device 'cuda:7': torch sees"),  # no GPU here, or fewer than 8 where there are some
    ],
)
def test_bad_configs_fail_before_training(task_data, tmp_path, args, message):
    detector, _ = task_data
    result = CliRunner().invoke(app, ["train", "finetune", "--out", str(tmp_path / "x"), "--detector", str(detector), *args])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("changes, message", [
    (dict(tasks={"vqa": math.nan}), "task weights must be finite numbers above 0, got vqa:nan"),
    (dict(tasks={"vqa": math.inf, "nlvr2": 1.0}), "task weights must be finite numbers above 0, got vqa:inf, nlvr2:1"),
    (dict(tasks={"vqa": 1e308, "nlvr2": 1e308}), "task weights must be finite numbers above 0"),  # their sum is not
    (dict(tasks={}), "tasks is empty"),
    (dict(tasks={"itm_rank": 1.0}, query_bank=4, query_bank_temperature=math.nan),
     "query_bank_temperature=nan above 0 and finite"),
    (dict(tasks={"itm_rank": 1.0}, query_bank=4, query_bank_temperature=math.inf),
     "query_bank_temperature=inf above 0 and finite"),
])
def test_weights_or_a_temperature_that_are_not_finite_fail_before_the_data_work(task_data, tmp_path, monkeypatch,
                                                                                changes, message):
    detector, _ = task_data
    no_data_work(monkeypatch)
    with pytest.raises(ValueError, match=re.escape(message)):
        train(tiny(tmp_path / "x", detector, **changes), progress=False)
    assert not (tmp_path / "x").exists()


def test_missing_detector_fails_before_training(tmp_path):
    result = CliRunner().invoke(app, ["train", "finetune", "--out", str(tmp_path / "x"), "--detector", str(tmp_path / "none")])
    assert result.exit_code == 2 and "detector directory not found" in result.stderr


def test_multiple_choice_collates_one_row_per_candidate(task_data):
    _, data = task_data
    questions = data.train["multiple_choice"][:3]
    assert questions and all(len(e.choices) == 4 and 0 <= e.label < 4 for e in questions) and data.eval["mc"]
    short = Example(questions[0].rows, "what color is the circle?", 1, ("red", "blue"))  # padded with copies of "red"
    inputs, labels = collate("multiple_choice", [*questions, short], data.train_table, VLTokenizer.pretrained_minilm(),
                             HeadConfig(kind="multiple_choice"))
    assert inputs.input_ids.shape[:2] == (4, 4) and inputs.region_features.shape[:2] == (4, 8)
    assert labels.tolist() == [e.label for e in questions] + [1]
    assert all(torch.equal(inputs.input_ids[3, c], inputs.input_ids[3, 0]) for c in (2, 3))
    assert (inputs.token_type_ids[:, :, 1] == 0).all() and (inputs.token_type_ids.amax(-1) == 1).all()  # choice: segment 1


def test_multiple_choice_alone_learns_and_reports_mc_acc(task_data, tmp_path):
    detector, data = task_data
    result = train(tiny(tmp_path / "mc", detector, tasks={"multiple_choice": 1.0}, steps=80), data=data, progress=False)
    losses = result["losses"]
    assert np.mean(losses[-15:]) < np.mean(losses[:15]) - 0.05, losses  # from ln 4; the untrained detector caps it
    assert set(result["final"]) == {"mc_acc"}


@pytest.fixture(scope="module")
def source_checkpoint(task_data, tmp_path_factory):
    """A few steps of lxmert tiny with itm and vqa heads: the checkpoint fine-tuning starts from."""
    detector, data = task_data
    out = tmp_path_factory.mktemp("source") / "enc"
    train(tiny(out, detector, tasks={"itm": 1.0, "vqa": 1.0}, steps=3), data=data, progress=False)
    return out


def test_init_from_copies_the_encoder_and_heads_of_the_same_name_and_shape(task_data, source_checkpoint, tmp_path):
    detector, data = task_data
    source = load_checkpoint(source_checkpoint).model.state_dict()
    cfg = tiny(tmp_path / "ft", detector, tasks={"itm": 1.0, "vqa": 1.0, "multiple_choice": 1.0}, init_from=source_checkpoint)
    model = build_model(cfg, data.feature_dim, len(data.answers))
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in source.items())  # encoder, itm and vqa heads
    assert not any(k.startswith("heads.multiple_choice.") for k in source)
    bigger = build_model(tiny(tmp_path / "x", detector, tasks={"vqa": 1.0}), data.feature_dim, len(data.answers) + 1)
    assert init_from_checkpoint(bigger, source_checkpoint) == []  # a vqa head over other answers stays fresh


@pytest.mark.parametrize("change, message", [
    ({"preset": "visualbert"}, "encoder.preset is 'lxmert', expected 'visualbert'"),
    ({"size": "small"}, "encoder.size is 'tiny', expected 'small'"),
    ({"feature_dim": 32}, "encoder.visual_feat_dim is 16, expected 32"),
])
def test_init_from_rejects_another_preset_size_or_feature_dim(task_data, source_checkpoint, tmp_path, change, message):
    detector, data = task_data
    feature_dim = change.pop("feature_dim", data.feature_dim)
    cfg = tiny(tmp_path / "ft", detector, init_from=source_checkpoint, **change)
    with pytest.raises(CheckpointError, match=message):
        build_model(cfg, feature_dim, len(data.answers))


def test_init_from_rejects_another_box_embedding_or_embedding_style(task_data, tmp_path):
    detector, data = task_data
    train(tiny(tmp_path / "linear", detector, preset="u-visualbert", embedding_style="vlserve", tasks={"vqa": 1.0}, steps=1),
          data=data, progress=False)
    cfg = tiny(tmp_path / "ft", detector, preset="u-visualbert", embedding_style="vlserve", box_embedding="normalized",
               init_from=tmp_path / "linear")
    with pytest.raises(CheckpointError, match="encoder.box_embedding is 'linear', expected 'normalized'"):
        build_model(cfg, data.feature_dim, len(data.answers))
    published = tiny(tmp_path / "ft", detector, preset="u-visualbert", init_from=tmp_path / "linear")  # the preset's style
    with pytest.raises(CheckpointError, match="encoder.embedding_style is 'vlserve', expected 'published'"):
        build_model(published, data.feature_dim, len(data.answers))
    for args, hint in ((["--embedding-style", "vlserve", "--box-embedding", "normalized"], "pass --box-embedding linear"),
                       ([], "pass --embedding-style vlserve")):
        result = CliRunner().invoke(app, ["train", "finetune", "--out", str(tmp_path / "x"), "--detector", str(detector),
                                          "--size", "tiny", "--preset", "u-visualbert", *args, "--init-from", str(tmp_path / "linear")])
        assert result.exit_code == 2 and hint in result.stderr, result.output


def test_num_layers_trains_a_shallower_encoder_and_init_from_checks_the_depth(task_data, tmp_path):
    """num_layers overrides the size's depth (tiny: 2); the checkpoint keeps it, and a run of another depth may
    not start from it."""
    detector, data = task_data
    train(tiny(tmp_path / "one", detector, preset="u-visualbert", tasks={"vqa": 1.0}, steps=2, num_layers=1), data=data,
          progress=False)
    ckpt = load_checkpoint(tmp_path / "one")
    assert ckpt.model.config.encoder.num_layers == 1 and len(ckpt.model.encoder.layer) == 1
    cfg = tiny(tmp_path / "ft", detector, preset="u-visualbert", init_from=tmp_path / "one")
    with pytest.raises(CheckpointError, match="encoder.num_layers is 1, expected 2"):
        build_model(cfg, data.feature_dim, len(data.answers))
    build_model(dataclasses.replace(cfg, num_layers=1), data.feature_dim, len(data.answers))
    result = CliRunner().invoke(app, ["train", "finetune", "--out", str(tmp_path / "x"), "--detector", str(detector),
                                      "--size", "tiny", "--preset", "u-visualbert", "--init-from", str(tmp_path / "one")])
    assert result.exit_code == 2 and "the encoder has 1 layers, the run 2 (pass --num-layers 1)" in result.stderr, result.output
    assert not (tmp_path / "x").exists()


def test_init_from_is_checked_before_training(task_data, source_checkpoint, tmp_path):
    detector, _ = task_data
    validate_finetune(tiny(tmp_path / "ok", detector, init_from=source_checkpoint, init_text=True))  # no MiniLM needed
    result = CliRunner().invoke(app, ["train", "finetune", "--out", str(tmp_path / "x"), "--detector", str(detector),
                                      "--size", "tiny", "--init-from", str(source_checkpoint)])
    assert result.exit_code == 2 and "--init-from: " in result.stderr and "expected 'visualbert'" in result.stderr, result.output
    assert not (tmp_path / "x").exists()


def test_frozen_word_embeddings_stay_fixed_while_the_rest_learns(task_data, tmp_path):
    detector, data = task_data
    torch.manual_seed(0)
    initial = build_model(tiny(tmp_path / "f", detector), data.feature_dim, len(data.answers))
    before = initial.encoder.embeddings.word_embeddings.weight.clone()
    train(tiny(tmp_path / "f", detector, steps=20, freeze_word_embeddings=True, seed=0), data=data, progress=False)
    after = load_checkpoint(tmp_path / "f").model
    torch.testing.assert_close(after.encoder.embeddings.word_embeddings.weight, before, rtol=0, atol=0)
    moved = [n for n, p in after.named_parameters() if "word_embeddings" not in n and not torch.equal(p, dict(initial.named_parameters())[n])]
    assert len(moved) > 0.8 * (len(list(after.parameters())) - 1)  # the rest trains (a few tensors get no gradient in 20 steps)


def test_dropout_option_reaches_the_encoder_config(tmp_path):
    from training.finetune import build_model

    for dropout, expected in ((None, 0.1), (0.0, 0.0)):
        model = build_model(tiny(tmp_path, tmp_path, dropout=dropout), feature_dim=16, num_answers=4)
        enc = model.config.encoder
        assert (enc.dropout, enc.attention_dropout) == (expected, expected)


def test_ranking_groups_hold_the_own_image_first_and_never_a_true_one(task_data):
    from training.data.vl_tasks import objects_key

    _, data = task_data
    groups = data.train["itm_rank"]
    assert len(groups) == 160 and "itm_rank" not in data.eval
    assert "itm_rank" not in prepare_task_data(task_data[0], 160, 80, easy_vqa=False, progress=False, data=SHAPES).train
    shapes = load_split_annotations(task_data)
    for g, e in enumerate(groups):
        own, *others = e.rows
        assert own == g and e.label == 0 and len(e.rows) == 8 and len(set(e.rows)) == 8
        assert e.text == shapes[own]["captions"][0]  # the listing caption, true of exactly its own key
        assert all(objects_key(shapes[o]) != objects_key(shapes[own]) for o in others)


def test_ranking_groups_by_objects_give_a_scene_one_group_per_object_each_with_its_own_negatives(task_data):
    from training.data.shapes_cache import ShapesSplit, load_split
    from training.data.vl_tasks import objects_key, ranking_examples

    split = load_split("train", SHAPES)
    scenes = ShapesSplit(split.directory, split.annotations[:60], [])
    plain, weighted = ranking_examples(scenes, seed=2), ranking_examples(scenes, seed=2, by_objects=True)
    assert len(plain) == 60
    per_scene = collections.Counter(e.rows[0] for e in weighted)
    assert per_scene == {i: len(a["objects"]) for i, a in enumerate(scenes.annotations)}
    for e in weighted:
        own, *others = e.rows
        assert e.text == scenes.annotations[own]["captions"][0] and len(set(e.rows)) == 8
        assert all(objects_key(scenes.annotations[o]) != objects_key(scenes.annotations[own]) for o in others)
    many = [i for i, n in per_scene.items() if n >= 3]
    assert any(len({e.rows[1:] for e in weighted if e.rows[0] == i}) > 1 for i in many)  # fresh negatives per copy


def load_split_annotations(task_data):
    from training.data.shapes_cache import load_split

    return load_split("train", SHAPES).annotations[:160]


def test_ranking_groups_put_the_closest_scenes_among_the_negatives():
    from training.data.shapes_cache import ShapesSplit
    from training.data.vl_tasks import ranking_examples

    def scene(*objects):
        return {"objects": [dict(zip(("size", "color", "shape"), o.split())) for o in objects], "captions": ["c"]}

    near = ("small red circle", "large blue triangle")
    anns = [scene(*near), scene("small red circle", "large blue rectangle"), scene(*near)]  # 0 and 2 share a key
    anns += [scene("large green rectangle", "small gray circle", "small gray triangle") for _ in range(10)]
    groups = ranking_examples(ShapesSplit(None, anns, []), group_size=4, hard=1, neighbours=1, seed=0)
    assert groups[0].rows[1] == 1  # the one-attribute neighbour is the hard negative
    assert 2 not in groups[0].rows and 0 not in groups[2].rows  # a scene with the same objects is never a negative


def test_partial_negatives_are_scenes_made_of_a_part_of_the_listing():
    """partial=K: K negatives whose every object the listing names (never the caption's own objects, never twice)."""
    from training.data.shapes_cache import ShapesSplit
    from training.data.vl_tasks import ranking_examples

    def scene(*objects):
        return {"objects": [dict(zip(("size", "color", "shape"), o.split())) for o in objects], "captions": ["c"]}

    long = ("small red circle", "large blue triangle", "small green rectangle", "large gray circle")
    anns = [scene(*long), scene(*long[:1]), scene(*long[1:3]), scene(*long[::-1])]  # 3 holds 0's objects: true of it
    other = ("large green rectangle", "small gray circle", "small gray triangle", "large red triangle", "small teal circle")
    anns += [scene(*other) for _ in range(10)]  # nothing in common with the listing
    split = ShapesSplit(None, anns, [])
    groups = [ranking_examples(split, group_size=5, hard=1, neighbours=1, seed=seed, partial=2)[0] for seed in range(8)]
    for group in groups:  # the closest scene (2: half the objects) is the hard one, then the other part, then random
        assert group.rows[:3] == (0, 2, 1) and 3 not in group.rows and len(set(group.rows)) == 5
    plain = [ranking_examples(split, group_size=5, hard=1, neighbours=1, seed=seed)[0] for seed in range(8)]
    assert sum(1 in g.rows for g in plain) < 8  # without: the one-object part only by chance
    # a one-object listing has no strict part: random scenes fill its group
    assert len(set(ranking_examples(split, group_size=5, hard=1, neighbours=1, seed=0, partial=2)[1].rows)) == 5


def test_caption_ranking_groups_hold_the_listing_first_then_false_near_misses(task_data):
    from training.data.shapes_cache import load_split

    _, data = task_data
    groups = data.train["itm_rank_text"]
    split = load_split("train", SHAPES)
    assert len(groups) == 160 and "itm_rank_text" not in data.eval
    for g, e in enumerate(groups):
        assert e.rows == (g,) and e.label == 0 and len(e.choices) == 7
        assert e.text == split.annotations[g]["captions"][0] and e.text not in e.choices
        assert len(set(e.choices)) == 7


@pytest.mark.parametrize("task", ["itm_rank", "itm_rank_text"])
def test_ranking_groups_collate_to_one_pair_per_candidate(task_data, task):
    """itm_rank: a caption with each of its 8 images; itm_rank_text: an image with each of its 8 captions."""
    _, data = task_data
    tok = VLTokenizer.pretrained_minilm(max_length=40)
    groups = data.train[task][:3]
    inputs, labels = collate(task, groups, data.train_table, tok, HeadConfig(kind="itm"))
    assert inputs.input_ids.shape[0] == 24 and labels.tolist() == [0, 0, 0]
    images = task == "itm_rank"
    rows = [r for e in groups for r in (e.rows if images else e.rows * 8)]
    texts = [t for e in groups for t in ([e.text] * 8 if images else (e.text, *e.choices))]
    torch.testing.assert_close(inputs.region_features, torch.from_numpy(data.train_table.features[rows]).float())
    expected = tok.encode(texts, max_length=40)["input_ids"][:, :inputs.input_ids.shape[1]]
    assert inputs.input_ids.tolist() == expected.tolist()


@pytest.mark.parametrize(("task", "rank_pool"), [("itm_rank", None), ("itm_rank_text", None), ("itm_rank", "pooled")])
def test_ranking_trains_the_itm_or_ranking_head_to_rank_the_true_pair_first(task_data, tmp_path, task, rank_pool):
    """itm_rank: each caption's own image among 8; itm_rank_text: each image's listing among 8 captions. Without
    rank_pool the ranking sets train the itm head; with it, a ranking head of their own beside the itm head."""
    import dataclasses

    from models import RANK_HEAD
    from training.retrieval import retrieval_head

    detector, data = task_data
    groups = data.train[task][:8]  # few enough for a tiny model to fit in a test's time
    data = dataclasses.replace(data, train={task: groups, "itm": data.train["itm"]})
    tok = VLTokenizer.pretrained_minilm(max_length=40)
    tasks = {task: 1.0} if rank_pool is None else {task: 1.0, "itm": 0.2}
    head = "itm" if rank_pool is None else RANK_HEAD

    def top1(model) -> float:
        inputs, _ = collate(task, groups, data.train_table, tok, model.config.heads[head])
        with torch.no_grad():
            logits = model.eval()(inputs, head).logits
        return ((logits[:, 1] - logits[:, 0]).view(len(groups), -1).argmax(1) == 0).float().mean().item()

    config = tiny(tmp_path / "r", detector, tasks=tasks, rank_pool=rank_pool)
    torch.manual_seed(0)
    before = top1(build_model(config, data.feature_dim, len(data.answers)))
    result = train(dataclasses.replace(config, steps=150), data=data, progress=False)
    model = load_checkpoint(tmp_path / "r").model
    if rank_pool is None:
        assert set(model.heads) == {"itm"}  # the ranking task trains the served itm head; no head of its own
    else:
        assert set(model.heads) == {"itm", RANK_HEAD}
        assert (model.config.heads[RANK_HEAD].kind, model.config.heads[RANK_HEAD].pool) == ("itm", "pooled")
    assert retrieval_head(model) == head
    if rank_pool is None:  # one task: every loss is a ranking loss
        assert np.mean(result["losses"][-20:]) < np.mean(result["losses"][:20])
    assert top1(model) >= max(before, 1 / 8) + 0.375, before  # chance: 1 of 8; untrained: 0 of 8 here


def test_itm_rank_passes_the_cli_checks(task_data, tmp_path):
    from vlserve.commands.train import validate_finetune

    detector, _ = task_data
    validate_finetune(tiny(tmp_path / "x", detector, tasks={"vqa": 1.0, "itm_rank": 1.0}, init_text=True, size="small"))


def test_lead_phase_trains_only_the_lead_tasks_then_all(task_data, tmp_path):
    """During lead_steps only the lead tasks' heads move (the others get no gradient); afterwards every head trains."""
    detector, data = task_data
    cfg = tiny(tmp_path / "lead", detector, tasks={"vqa": 1.0, "refer": 1.0, "nlvr2": 1.0}, steps=24,
               lead_tasks=("refer",), lead_steps=12, seed=3)
    torch.manual_seed(3)
    initial = {k: v.clone() for k, v in build_model(cfg, data.feature_dim, len(data.answers)).state_dict().items()}

    def moved_heads(model) -> set[str]:
        state = model.state_dict()
        return {k.split(".")[1] for k in state if k.startswith("heads.") and not torch.equal(state[k], initial[k])}

    train(cfg, data=data, progress=False, stop_after=12)
    state = torch.load(tmp_path / "lead" / "train_state.pt", weights_only=True)
    model = build_model(cfg, data.feature_dim, len(data.answers))
    model.load_state_dict(state["model"])
    assert moved_heads(model) == {"refer"}
    train(cfg, data=data, progress=False)  # resumes at step 12: all three tasks from here on
    assert moved_heads(load_checkpoint(tmp_path / "lead").model) == {"vqa", "refer", "nlvr2"}


def test_lead_stalled_compares_the_lead_phases_first_and_last_steps():
    from training.finetune import lead_stalled

    cfg = FinetuneConfig(tasks={"refer": 1.0, "vqa": 1.0}, lead_tasks=("refer",), lead_steps=100, lead_takeoff=0.8)
    plateau = [1.38] * 100 + [0.1] * 50  # the mix's later losses do not count
    assert lead_stalled(cfg, plateau) == (True, pytest.approx(1.38), pytest.approx(1.38))
    took_off = [1.4] * 25 + [0.5] * 75
    assert lead_stalled(cfg, took_off) == (False, pytest.approx(1.4), pytest.approx(0.5))
    assert lead_stalled(cfg, [1.0] * 75 + [0.81] * 25)[0] and not lead_stalled(cfg, [1.0] * 75 + [0.79] * 25)[0]


@pytest.mark.parametrize("takeoff, restarts", [(0.0, 2), (1e9, 0)])  # 0: no loss is below 0 x its start, a stall every time
def test_a_stalled_lead_starts_the_run_again_with_the_next_seed(task_data, tmp_path, takeoff, restarts):
    detector, data = task_data
    cfg = tiny(tmp_path / "lead", detector, tasks={"vqa": 1.0, "refer": 1.0}, steps=16, lead_tasks=("refer",), lead_steps=6,
               lead_retries=2, lead_takeoff=takeoff, seed=5)
    result = train(cfg, data=data, progress=False)
    assert result["lead_restarts"] == restarts and result["config"]["seed"] == 5 + restarts
    assert len(result["losses"]) == 16  # each restart began at step 0
    saved = json.loads((tmp_path / "lead" / "metrics.json").read_text())
    assert saved["lead_restarts"] == restarts and not (tmp_path / "lead" / "train_state.pt").exists()
    # the last run is the plain run of that seed: the same losses
    again = train(dataclasses.replace(cfg, out=tmp_path / "plain", seed=5 + restarts, lead_retries=0), data=data, progress=False)
    assert again["losses"] == result["losses"] and again["lead_restarts"] == 0
    # interrupted after its restarts and resumed: it goes on with the seed they reached, to the same losses
    resumed = dataclasses.replace(cfg, out=tmp_path / "resumed")
    assert "interrupted_at" in train(resumed, data=data, progress=False, stop_after=10)
    assert (tmp_path / "resumed" / "lead_restarts.txt").exists() == bool(restarts)
    final = train(resumed, data=data, progress=False)
    assert final["losses"] == result["losses"] and final["lead_restarts"] == restarts
    assert final["config"]["seed"] == 5 + restarts and not (tmp_path / "resumed" / "lead_restarts.txt").exists()


@pytest.mark.parametrize("lead, message", [
    (dict(lead_tasks=("refer",), lead_steps=40), "fewer than steps=40"),
    (dict(lead_steps=5), "lead_steps needs lead_tasks"),
    (dict(lead_tasks=("itm",), lead_steps=5), "lead task(s) itm not among the run's tasks"),
])
def test_bad_lead_phase_fails_before_training(task_data, tmp_path, lead, message):
    detector, data = task_data
    with pytest.raises(ValueError, match=re.escape(message)):
        train(tiny(tmp_path / "bad", detector, steps=40, **lead), data=data, progress=False)
    assert not (tmp_path / "bad").exists()


def test_curriculum_phases_train_their_tasks_in_order_then_the_mix(task_data, tmp_path):
    """refer alone, then one-side position questions through the vqa head, then both-sided ones, then the mix (vqa
    and nlvr2): the sampler draws only a phase's tasks inside it; position questions are scored on val."""
    detector, data = task_data
    cfg = tiny(tmp_path / "curriculum", detector, tasks={"vqa": 1.0, "refer": 1.0, "nlvr2": 1.0}, steps=30,
               lead_tasks=("refer",), lead_steps=5, curriculum=((5, ("positions_one_side",)), (5, ("positions",))))
    names = training_tasks(cfg)
    assert names == ["vqa", "refer", "nlvr2", "positions_one_side", "positions"]
    phases = [(end, [n for n, w in zip(names, weights) if w > 0]) for end, weights in phase_weights(cfg)]
    assert phases == [(5, ["refer"]), (10, ["positions_one_side"]), (15, ["positions"]), (30, ["vqa", "refer", "nlvr2"])]
    assert data.train["positions_one_side"] and all(e.text.endswith(("on the left?", "at the top?"))
                                                    for e in data.train["positions_one_side"])
    assert len(data.train["positions"]) > len(data.train["positions_one_side"]) and "positions_one_side" not in data.eval
    torch.manual_seed(0)
    initial = build_model(cfg, data.feature_dim, len(data.answers)).state_dict()
    train(cfg, data=data, progress=False, stop_after=10)  # lead + one-side phase: vqa and refer heads, never nlvr2
    state = torch.load(tmp_path / "curriculum" / "train_state.pt", weights_only=True)["model"]
    moved = {k.split(".")[1] for k in state if k.startswith("heads.") and not torch.equal(state[k], initial[k])}
    assert moved == {"refer", "vqa"}
    result = train(cfg, data=data, progress=False)
    assert {"vqa_acc", "refer_acc", "nlvr2_acc", "positions_acc"} <= set(result["final"])
    assert set(load_checkpoint(tmp_path / "curriculum").model.heads) == {"vqa", "refer", "nlvr2"}


@pytest.mark.parametrize("name,kinds,questions", [("relations", ("relation",), relation_questions),
                                                   ("attributes", ("color", "shape", "size"), all_attribute_questions)])
def test_question_sets_hold_every_question_of_their_kind_of_each_training_scene(task_data, name, kinds, questions):
    """'relations' asks every clear relation between uniquely described objects of a scene, 'attributes' the
    colour, shape and size of every object that can be described without it (through the vqa head); a scene's VQA
    questions sample vqa_per_type of each kind. Training material only: not scored on val."""
    _, data = task_data
    split = load_split("train", SHAPES)
    for row in (0, 1, 2):
        asked = [(e.text, data.answers[e.label]) for e in data.train[name] if e.rows == (row,)]
        assert asked == [(q["question"], q["answer"]) for q in questions(split.scene(row))]
    every = {(e.rows[0], e.text) for e in data.train[name]}
    sampled = {(i, q["question"]) for i, ann in enumerate(split.annotations[:160]) for q in ann["vqa"] if q["type"] in kinds}
    assert sampled and sampled < every
    assert name not in data.eval and head_of(name) == "vqa"


def test_related_sets_train_the_vqa_and_refer_heads(task_data, tmp_path):
    """related_attributes ("what color is the shape left of the red circle?") trains the vqa head, related_refer
    ("the shape left of the red circle") the refer head with its referent's box; both hold what the generators
    give each training scene, and neither is scored on val."""
    detector, data = task_data
    split = load_split("train", SHAPES)
    for row in (0, 1, 2, 3):
        scene = split.scene(row)
        assert [(e.text, data.answers[e.label]) for e in data.train["related_attributes"] if e.rows == (row,)] == \
            [(q["question"], q["answer"]) for q in related_attribute_questions(scene)]
        assert [(e.text, e.label) for e in data.train["related_refer"] if e.rows == (row,)] == \
            [(r["expression"], tuple(r["box"])) for r in related_expressions(scene)]
    assert data.train["related_attributes"] and data.train["related_refer"]
    assert head_of("related_attributes") == "vqa" and head_of("related_refer") == "refer"
    assert not {"related_attributes", "related_refer"} & set(data.eval)
    cfg = tiny(tmp_path / "related", detector, tasks={"vqa": 1.0, "refer": 1.0, "related_refer": 1.0}, steps=6,
               lead_tasks=("related_refer",), lead_steps=3)
    torch.manual_seed(0)
    initial = build_model(cfg, data.feature_dim, len(data.answers)).state_dict()
    train(cfg, data=data, progress=False, stop_after=3)  # the lead phase: related_refer alone, through the refer head
    state = torch.load(tmp_path / "related" / "train_state.pt", weights_only=True)["model"]
    assert {k.split(".")[1] for k in state if k.startswith("heads.") and not torch.equal(state[k], initial[k])} == {"refer"}


@pytest.mark.parametrize("curriculum, message", [
    (((0, ("positions",)),), "needs a positive step count"),
    (((5, ("where",)),), "curriculum task(s) where unknown"),
    (((20, ("positions",)), (20, ("refer",))), "take 40 steps, not fewer than steps=40"),
])
def test_bad_curriculum_fails_before_training(task_data, tmp_path, curriculum, message):
    detector, data = task_data
    with pytest.raises(ValueError, match=re.escape(message)):
        train(tiny(tmp_path / "bad", detector, steps=40, curriculum=curriculum), data=data, progress=False)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("curriculum, message", [
    ("positions_one_side:200", "is not TASKS=STEPS"),
    ("positions=many", "is not TASKS=STEPS"),
    ("refer+where=10", "curriculum task(s) where unknown"),
])
def test_curriculum_option_on_the_command_line_is_checked(task_data, tmp_path, curriculum, message):
    detector, _ = task_data
    result = CliRunner().invoke(app, ["train", "finetune", "--out", str(tmp_path / "x"), "--detector", str(detector),
                                      "--curriculum", curriculum])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert not (tmp_path / "x").exists()


def test_lead_options_on_the_command_line_are_checked(task_data, tmp_path):
    detector, _ = task_data
    result = CliRunner().invoke(app, ["train", "finetune", "--out", str(tmp_path / "x"), "--detector", str(detector),
                                      "--tasks", "vqa:1,nlvr2:1", "--lead-tasks", "refer", "--lead-steps", "10"])
    assert result.exit_code == 2 and "lead task(s) refer not among the run's tasks (vqa, nlvr2)" in result.stderr, result.output
    assert not (tmp_path / "x").exists()


def test_region_tags_give_each_region_its_detector_class_word(task_data, tmp_path):
    detector, data = task_data
    tokenizer = VLTokenizer.pretrained_minilm()
    # one word per region, summed into it (the vlserve embedding style; the published one: test_u_visualbert_preset.py)
    cfg = tiny(tmp_path / "tags", detector, preset="u-visualbert", embedding_style="vlserve", region_tags=True,
               tasks={"vqa": 1.0}, steps=2)
    model = build_model(cfg, data.feature_dim, len(data.answers)).eval()
    assert tagged(data, build_model(tiny(tmp_path / "x", detector), data.feature_dim, len(data.answers)), tokenizer) is data
    examples = data.train["vqa"][:4]
    with_tags, _ = collate("vqa", examples, tagged(data, model, tokenizer).train_table, tokenizer, model.config.heads["vqa"])
    without, _ = collate("vqa", examples, data.train_table, tokenizer, model.config.heads["vqa"])
    classes = data.train_table.obj_ids[[e.rows[0] for e in examples]]  # (4, N), -1 = padding
    words = np.array([tokenizer.word_id(name) for name in data.objects])
    assert without.tag_ids is None
    assert with_tags.tag_ids.tolist() == np.where(classes >= 0, words[classes.clip(min=0)], -1).tolist()
    with torch.no_grad():
        assert not torch.allclose(model(with_tags, "vqa").logits, model(without, "vqa").logits)
    train(cfg, data=data, progress=False)
    assert load_checkpoint(tmp_path / "tags").model.config.encoder.region_tags


def test_a_retrieval_stage_starts_from_the_multitask_checkpoint_keeps_every_head_and_reports_retrieval(task_data, tmp_path):
    import dataclasses

    from training.finetune import RANK_TASKS

    detector, data = task_data
    first = tiny(tmp_path / "multitask", detector, tasks={"vqa": 1.0, "itm": 1.0}, steps=30)
    train(first, data=data, progress=False)
    # a retrieval stage as the zoo's recipes write one: a replace() of the multi-task run
    cfg = dataclasses.replace(first, out=tmp_path / "encoder", init_from=first.out, steps=30, warmup=50, lead_tasks=RANK_TASKS,
                              lead_steps=10, tasks={**first.tasks, "itm_rank": 4.0, "itm_rank_text": 4.0},
                              retrieval_queries=20, retrieval_pool=60, query_bank=16, query_bank_temperature=0.5)
    assert (cfg.query_bank, cfg.query_bank_temperature) == (16, 0.5)
    result = train(cfg, data=data, progress=False)
    encoder = load_checkpoint(tmp_path / "encoder")
    assert set(encoder.model.heads) == {"vqa", "itm"}
    bank = QueryBank.from_labels(encoder.labels)  # 16 listing captions of the training groups
    assert len(bank.texts) == 16 and bank.temperature == 0.5
    assert set(bank.texts) <= {e.text for e in data.train["itm_rank"]}
    final = result["final"]
    assert {"vqa_acc", "itm_acc"} <= set(final)
    assert (final["retrieval_pool"], final["retrieval_queries"]) == (60, 20)  # the first 60 of 80 val scenes, 20 captions
    assert final["retrieval_query_bank"] == 16 and 0.0 <= final["retrieval_t2i_raw_R@1"] <= 1.0
    # the card's R@K is the bank-normalised ranking's: recomputed here by hand from the raw grid
    from models.query_bank import normalised
    from training.retrieval import itm_scorer, pool_priors, query_sample, retrieval_head, score_grid

    examples, head = data.eval["retrieval"][:60], retrieval_head(encoder.model)
    with gemm_precision(encoder.model, result["eval_precision"]):
        grid = score_grid(itm_scorer(encoder.model, head, examples, data.eval_table, encoder.tokenizer),
                          query_sample(60, 20), np.arange(60))
        priors = pool_priors(encoder.model, head, bank, [e.rows[0] for e in examples], data.eval_table, encoder.tokenizer)
    q = query_sample(60, 20)
    ranked = normalised(grid.numpy(), priors.numpy(), 0.5).argmax(1)
    assert final["retrieval_t2i_R@1"] == pytest.approx((ranked == q).mean(), abs=1e-6)
    assert final["retrieval_t2i_raw_R@1"] == pytest.approx((grid.numpy().argmax(1) == q).mean(), abs=1e-6)
    for k in ("R@1", "R@5", "R@10", "any_true_R@1"):
        assert 0.0 <= final[f"retrieval_t2i_{k}"] <= 1.0
    assert final["retrieval_t2i_R@1"] <= final["retrieval_t2i_any_true_R@1"] and final["retrieval_t2i_R@5"] <= final["retrieval_t2i_R@10"]
    assert "retrieval_t2i_R@1" not in train(dataclasses.replace(first, out=tmp_path / "again", steps=2), data=data,
                                             progress=False)["final"]  # retrieval_queries=0: no retrieval scoring


def test_batches_keep_only_the_region_slots_some_image_needs_and_score_the_same():
    """collate drops the trailing region slots that are padding in every image of a batch (adaptive regions: 1 to 8
    per image); every head reads the same logits as from the fully padded batch, and refer targets keep their places."""
    from models import create_model
    from training.data.region_table import RegionTable

    rng = np.random.default_rng(0)
    m, n, d = 4, 8, 16
    lo = rng.uniform(0, 0.5, (m, n, 2)).astype(np.float32)
    boxes = np.concatenate([lo, lo + 0.3], -1)
    mask = (np.arange(n) < np.array([[2], [5], [1], [3]])).astype(np.int64)
    table = RegionTable(features=rng.normal(size=(m, n, d)).astype(np.float16), boxes=boxes, pixel_boxes=boxes * 64,
                        mask=mask, obj_ids=np.where(mask, 0, -1), image_feature=None)
    assert (table.width([0, 2]), table.width([1, 3]), table.width(np.array([[0, 3], [2, 2]]))) == (2, 5, 3)
    heads = {"vqa": HeadConfig(kind="vqa", num_labels=5, pool="regions_film"), "refer": HeadConfig(kind="refer"),
             "itm": HeadConfig(kind="itm", pool="regions"), "nlvr2": HeadConfig(kind="nlvr2", pool="regions")}
    torch.manual_seed(0)
    model = create_model("u-visualbert", "tiny", heads=heads, visual_feat_dim=d, box_embedding="normalized",
                         embedding_style="vlserve").eval()
    tok = VLTokenizer.pretrained_minilm(max_length=40)
    batches = {
        "vqa": [Example((0,), "what colour is the circle?", 1), Example((3,), "how many squares?", 2)],
        "refer": [Example((0,), "the red circle", tuple(float(v) for v in boxes[0, 1] * 64)),
                  Example((2,), "the blue one", tuple(float(v) for v in boxes[2, 0] * 64))],
        "itm": [Example((2,), "a red circle.", 1), Example((3,), "two squares.", 0)],
        "nlvr2": [Example((0, 2), "there is a circle.", 1), Example((2, 3), "both have squares.", 0)],
    }
    for kind, examples in batches.items():
        inputs, labels = collate(kind, examples, table, tok, heads[kind])
        rows = np.array([e.rows if kind == "nlvr2" else e.rows[0] for e in examples])
        assert inputs.region_mask.shape[-1] == table.width(rows) < n
        padded = dataclasses.replace(inputs, **table.tensors(rows))
        with torch.no_grad():
            trimmed, full = model(inputs, kind).logits, model(padded, kind).logits
        if kind == "refer":  # one logit per region slot: the dropped slots were masked out
            assert torch.allclose(trimmed, full[:, :trimmed.shape[1]], atol=1e-5)
            assert labels.sum() > 0 and labels.shape == trimmed.shape
        else:
            assert torch.allclose(trimmed, full, atol=1e-5), kind
    # evaluation concatenates batches of different widths: per-region logits come back in the table's 8 slots
    from training.evaluate import predictions

    refer = [Example((row,), "the red circle", (0.0, 0.0, 1.0, 1.0)) for row in range(m)]
    one_by_one, together = (predictions(model, "refer", refer, table, tok, batch_size=b) for b in (1, m))
    assert one_by_one.shape == together.shape == (m, n)
    assert torch.allclose(one_by_one, together, atol=1e-5)
    assert (one_by_one.argmax(-1) < torch.from_numpy(mask.sum(1))).all()  # never a padding slot


def test_init_from_a_checkpoint_of_another_detector_is_refused_before_training(task_data, source_checkpoint, tmp_path):
    """Another detector of the same feature dim: its regions are not the ones the checkpoint learned."""
    detector, _ = task_data
    torch.manual_seed(1)
    cfg = DetectorConfig(classes=["circle", "rectangle", "triangle"], attributes=["red"], min_size=64, max_size=128,
                         rpn_pre_nms_top_n=100, rpn_post_nms_top_n=30, num_boxes=8, feature_dim=16)
    other = tmp_path / "other_detector"
    save_detector(RegionDetector(cfg), other)
    ours, theirs = detector_fingerprint(detector), detector_fingerprint(other)
    assert ours != theirs
    with pytest.raises(ValueError, match=re.escape(f"--init-from: {source_checkpoint} was trained on the regions of "
                                                   f"detector {ours}, --detector {other} is detector {theirs}")):
        validate_finetune(tiny(tmp_path / "x", other, init_from=source_checkpoint))
    result = CliRunner().invoke(app, ["train", "finetune", "--out", str(tmp_path / "x"), "--detector", str(other),
                                      "--preset", "lxmert", "--size", "tiny", "--no-init-text",
                                      "--init-from", str(source_checkpoint)])
    assert result.exit_code == 2 and result.stderr.startswith(f"error: --init-from: {source_checkpoint} was trained "
                                                              f"on the regions of detector {ours}"), result.output
    assert not (tmp_path / "x").exists()


def test_a_query_bank_or_choices_the_data_cannot_fit_fail_before_the_first_step(task_data, tmp_path, monkeypatch):
    """Found with the data, not after the training: more bank captions than the training scenes' distinct listings,
    and a max_length the longest multiple-choice answer leaves no question token in."""
    detector, data = task_data
    monkeypatch.setattr(finetune_module, "build_model", lambda *a, **k: pytest.fail("the run started training"))
    captions = len({e.text for e in data.train["itm_rank"]})
    with pytest.raises(TrainingError, match=re.escape(f"query_bank={captions + 1} needs as many distinct listing "
                                                      f"captions of the training scenes, they have {captions}")):
        train(tiny(tmp_path / "bank", detector, tasks={"itm_rank": 1.0}, query_bank=captions + 1), data=data,
              progress=False)
    with pytest.raises(TrainingError, match=r"max_length=5 leaves no room for the text: multiple choice needs at "
                                            r"least \d+ tokens"):
        train(tiny(tmp_path / "mc", detector, tasks={"multiple_choice": 1.0}, max_length=5), data=data, progress=False)
