"""`vlserve zoo build`: its options (--root moves every cache the build writes, unknown profiles exit 2), the profiles'
recipes, the model card rendered from them, and a build that gives the same weights for the same recipe."""
import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

import training.zoo
from models import RANK_HEAD
from training.data.shapes_cache import ShapesConfig, cache_root
from training.data.shapes_world import WorldConfig
from training.detector_train import DetectorTrainConfig
from training.run_config import FinetuneConfig
from vlserve.cli import app

runner = CliRunner()


def test_root_is_the_cache_root_of_the_whole_build(tmp_path, monkeypatch):
    seen = {}

    def build_zoo(profile, root, force=False, threads=2, progress=True, device="cpu"):
        seen.update(profile=profile, root=root, cache=cache_root(), device=device)  # where data and region features will go
        return root / "zoo" / profile

    monkeypatch.delenv("VLSERVE_CACHE", raising=False)
    monkeypatch.setattr(training.zoo, "build_zoo", build_zoo)
    result = runner.invoke(app, ["zoo", "build", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen == {"profile": "demo", "root": tmp_path, "cache": tmp_path, "device": "cpu"}
    monkeypatch.delenv("VLSERVE_CACHE", raising=False)  # the command set it for its own process
    assert "VLSERVE_CACHE" not in os.environ


@pytest.mark.parametrize("where", ["--root", "VLSERVE_CACHE"])
def test_a_cache_root_it_cannot_write_exits_2_before_building(tmp_path, monkeypatch, where):
    def build_zoo(*args, **kwargs):
        raise AssertionError("the build started")

    def build(root):
        """zoo build's stderr, with `root` as --root or as $VLSERVE_CACHE, and the error line it should be."""
        if where == "--root":
            result, label = runner.invoke(app, ["zoo", "build", "--root", str(root)]), f"--root {root}"
        else:
            monkeypatch.setenv("VLSERVE_CACHE", str(root))
            result, label = runner.invoke(app, ["zoo", "build"]), f"VLSERVE_CACHE={root}"
        assert result.exit_code == 2, result.output
        return result.stderr, f"error: {label}: not a writable directory"

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(training.zoo, "build_zoo", build_zoo)
    (tmp_path / "afile").touch()
    said, expected = build(tmp_path / "afile")
    assert said == f"{expected} (it is a file)\n"
    said, expected = build(tmp_path / "afile" / "cache")
    assert said == f"{expected} ({tmp_path / 'afile'} is a file)\n"
    monkeypatch.setattr("tempfile.mkdtemp", refused)  # as in a read-only directory (root may write in any other)
    said, expected = build(tmp_path / "cache")
    assert said == f"{expected} (cannot create it in {tmp_path}: Permission denied)\n"


def test_unknown_profile_exits_2():
    result = runner.invoke(app, ["zoo", "build", "--profile", "huge"])
    assert result.exit_code == 2 and "unknown profile 'huge'" in result.output


@pytest.mark.parametrize("device, message", [("tpu", "device 'tpu' unknown: choose cpu, cuda or cuda:N"),
                                             ("cuda:7", "device 'cuda:7': torch sees")])
def test_a_device_it_cannot_train_on_exits_2_before_building(device, message, tmp_path):
    result = runner.invoke(app, ["zoo", "build", "--root", str(tmp_path / "cache"), "--device", device])
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "cache").exists()


def test_detector_training_on_a_device_it_cannot_use_exits_2(tmp_path):
    result = runner.invoke(app, ["train", "detector", "--out", str(tmp_path / "det"), "--device", "cuda:7"])
    assert result.exit_code == 2 and "device 'cuda:7': torch sees" in result.output
    assert not (tmp_path / "det").exists()


DETECTOR_METRICS = {"val": {"map50": 0.98}, "fingerprint": "f" * 16}


def card(recipe, root, metrics=None, **kw):
    """The card of `recipe` built at root (its detector's metrics.json written there)."""
    placed = training.zoo.placed(recipe, root)
    placed["detector"].out.mkdir(parents=True, exist_ok=True)
    (placed["detector"].out / "metrics.json").write_text(json.dumps(DETECTOR_METRICS))
    return training.zoo.model_card("demo", placed, metrics or {"final": {}, "train_seconds": 60}, det_seconds=60,
                                   total_seconds=120, **kw)


def with_runs(recipe, **changes):
    """recipe with `changes` applied to both encoder fine-tuning runs (the multi-task run and the retrieval stage)."""
    return {**recipe, **{name: replace(recipe[name], **changes) for name in ("finetune", "retrieval") if name in recipe}}


def test_the_demo_recipe_places_its_runs_under_the_model_set(tmp_path):
    demo = training.zoo.PROFILES["demo"]
    assert list(demo) == ["detector", "finetune", "retrieval"]  # the order they run in
    runs = training.zoo.placed(demo, tmp_path, threads=3, device="cuda")
    first, stage = runs["finetune"], runs["retrieval"]
    assert (runs["detector"].out, first.out, stage.out) == (tmp_path / "detector", tmp_path / "multitask", tmp_path / "encoder")
    assert first.detector_dir == stage.detector_dir == tmp_path / "detector" and stage.init_from == first.out
    assert {r.threads for r in runs.values()} == {3} and {r.device for r in runs.values()} == {"cuda"}
    assert (first.preset, first.dropout, first.bf16, first.vqa_pool, first.itm_pool, first.nlvr2_pool) == \
        ("u-visualbert", 0.0, True, "regions_film", "regions", "regions")
    assert {"positions", "relations", "attributes"} <= set(first.tasks)
    assert runs["detector"].detector["conf_thresh"] == 0.3  # the demo keeps the confident regions
    assert first.eval_every == first.steps  # evaluated once, at the end (the build's time)
    assert first.retrieval_queries == 0 and first.final_eval_examples == training.zoo.BEFORE_STAGE_EXAMPLES
    assert (stage.lead_tasks, stage.lead_steps, stage.lead_retries, stage.curriculum) == (("itm_rank", "itm_rank_text"), 300, 0, ())
    assert (stage.tasks["related_attributes"], stage.tasks["related_refer"]) == (3.0, 2.0)
    assert not {"related_attributes", "related_refer"} & set(first.tasks)
    assert (stage.tasks["relations"], stage.tasks["attributes"], stage.tasks["itm_rank"]) == (1.5, 1.5, 6.0)
    assert (first.tasks["relations"], first.tasks["attributes"]) == (0.5, 0.5)  # the multi-task run keeps its own
    assert (first.seed, stage.seed, first.lead_retries) == (2, 2, 2)


def test_the_full_profile_trains_the_demo_recipe_on_all_the_data():
    demo, full = training.zoo.PROFILES["demo"], training.zoo.PROFILES["full"]
    first = full["finetune"]
    assert (first.lead_tasks, first.lead_steps, first.steps, first.curriculum) == (("refer",), 200, 3_000, demo["finetune"].curriculum)
    assert (first.train_scenes, first.eval_scenes, first.easy_vqa_images, full["retrieval"].final_eval_examples) == \
        (20_000, 2_000, None, None)
    assert full["retrieval"].steps > demo["retrieval"].steps and full["retrieval"].query_bank == demo["retrieval"].query_bank
    assert full["detector"].final_eval_images is None and full["detector"].eval_every == full["detector"].steps


def test_the_pretrained_profile_is_the_demo_after_a_grounded_pretraining(tmp_path):
    demo, pretrained = training.zoo.PROFILES["demo"], training.zoo.PROFILES["pretrained"]
    assert list(pretrained) == ["detector", "pretrain", "finetune", "retrieval"]
    assert {**pretrained, "finetune": replace(pretrained["finetune"], init_from=None)} == {**demo, "pretrain": pretrained["pretrain"]}
    runs = training.zoo.placed(pretrained, tmp_path)
    pre = runs["pretrain"]
    assert (pre.preset, pre.embedding_style, pre.box_embedding, pre.steps, pre.objectives, pre.num_layers) == \
        ("u-visualbert", "vlserve", "normalized", 1500, ("mlm", "itm"), 4)
    assert (pre.mlm_words, pre.mlm_matched_only, pre.mask_prob, pre.easy_vqa, pre.train_scenes) == ("grounded", True, 0.5, False, 3000)
    assert runs["finetune"].init_from == pre.out == tmp_path / "pretrained"


def test_the_card_renders_the_demo_recipe(tmp_path):
    demo = training.zoo.PROFILES["demo"]
    text = card(demo, tmp_path, {"final": {"vqa_acc": 0.75}, "train_seconds": 600, "train_precision": "bf16", "eval_precision": "bf16"})
    assert "dropout 0; metrics computed with bf16 GEMMs." in text and "| vqa_acc | 0.75 |" in text
    assert "bfloat16 autocast training, word embeddings frozen, normalized box embedding, dropout 0" in text
    published = {stage: replace(run, embedding_style=None, box_embedding="linear") if stage != "detector" else run
                 for stage, run in demo.items()}  # the preset's embeddings
    assert ("word embeddings frozen, its authors' embeddings (layer-normalised features plus layer-normalised "
            "Linear(4, H) box), dropout 0") in card(published, tmp_path, {"final": {}, "train_seconds": 600})
    assert "trained 200 steps (batch 8)" in text and "(hidden 384, 4 layers, text side from the first 4 layers" in text
    assert ("trained together for 1400 steps (the first 200 on refer alone, then 400 on vqa + refer + itm + nlvr2 alone, "
            "then 400 on positions_one_side + vqa alone, then 300 on positions + vqa alone)") in text
    assert ("; the mix also draws the positions set (weight 0.5, through the vqa head), the relations set (weight 0.5, "
            "through the vqa head) and the attributes set (weight 0.5, through the vqa head).") in text
    assert "the regions with confidence >= 0.3 (1 to 8 per image)" in text
    assert "attributes: 8 colours, 2 sizes, their loss weighted 4)" in text
    assert "Then a retrieval stage of 1800 steps (the first 300 on the ranking sets alone) from that checkpoint" in text
    assert ("(every head kept): the mix (with vqa at 3, nlvr2 at 4, relations at 1.5 (through the vqa head), attributes at 1.5 "
            "(through the vqa head), related_attributes at 3 (through the vqa head) and related_refer at 2 (through the "
            "refer head)) plus ranking groups at weight 6 each") in text
    assert "The encoder keeps 256 listing captions of the training scenes as its query bank" in text
    assert "temperature 2; retrieval_t2i_raw_R@1: the raw scores)" in text
    assert "Training time 10.0 min (the retrieval stage)." in text and "No pretraining stage" in text
    assert "the first 2000 examples of each; retrieval: text -> image over the first 250 val scenes) | value |" in text
    fallback = card(demo, tmp_path, {"final": {}, "train_seconds": 600, "train_precision": "fp32"})
    assert "float32 training (bf16 asked for; this CPU has no native bf16), word embeddings frozen" in fallback
    full = card(training.zoo.PROFILES["full"], tmp_path)
    assert "trained together for 3000 steps (the first 200 on refer alone" in full and "ITM from regions, NLVR2 from regions" in full
    assert "Then a retrieval stage of 4000 steps" in full and "retrieval: text -> image over the first 1000 val scenes) | value |" in full


def test_the_card_follows_the_recipe(tmp_path):
    demo = training.zoo.PROFILES["demo"]
    six = card(with_runs(demo, num_layers=None), tmp_path)
    assert "(hidden 384, 6 layers, text side from the pretrained MiniLM-L6)" in six
    fixed = {**demo, "detector": replace(demo["detector"], detector={"num_boxes": 8, "rpn_post_nms_top_n": 100})}
    assert "8 regions per image" in card(fixed, tmp_path)
    phased = {**demo, "finetune": replace(demo["finetune"], curriculum=((200, ("positions_one_side",)), (100, ("positions", "refer"))),
                                          tasks={"vqa": 1.0, "refer": 1.0, "itm": 1.0, "nlvr2": 1.0, "positions": 0.25})}
    text = card(phased, tmp_path)
    assert "(the first 200 on refer alone, then 200 on positions_one_side alone, then 100 on positions + refer alone)" in text
    assert "; the mix also draws the positions set (weight 0.25, through the vqa head)." in text
    shared = card(with_runs(demo, rank_pool=None), tmp_path)
    assert f"heads\nvqa, refer, itm, nlvr2, {RANK_HEAD}, trained together" in card(demo, tmp_path)
    assert ("listwise plus pairwise cross-entropy through a ranking head of their own (rank, reading pooled; /retrieve ranks "
            "with it).") in card(demo, tmp_path)
    assert "heads\nvqa, refer, itm, nlvr2, trained together" in shared and "listwise cross-entropy through the itm head." in shared
    assert "weighted" not in card({**demo, "detector": replace(demo["detector"], attribute_weight=1.0)}, tmp_path)
    alone = {"detector": demo["detector"], "finetune": replace(demo["retrieval"], init_from=None)}
    assert "retrieval stage" not in card(alone, tmp_path)


def test_the_card_reports_the_pretraining_and_the_multitask_run(tmp_path):
    pretrained = {"train_seconds": 750, "final": {"itm_acc": 0.5, "mlm_grounded_acc": 0.7625, "mlm_grounded_acc_other_image": 0.5656}}
    text = card(training.zoo.PROFILES["pretrained"], tmp_path, pretrained=pretrained)
    assert ("Pretrained first for 1500 steps (mlm + itm; masked LM of the detector's class and attribute words only, on "
            "matched pairs only, mask rate 0.5) on the same scenes' captions in 12.5 min; masked class and attribute words "
            "recovered 0.762 with the caption's image, 0.566 with another; fine-tuning starts from that encoder.") in text
    multitask = {"train_seconds": 480, "final": {"vqa_acc": 0.83, "itm_acc": 0.72, "vqa_acc_number": 0.71}}
    metrics = {"final": {"vqa_acc": 0.84, "retrieval_t2i_R@1": 0.74}, "train_seconds": 420}
    text = card(training.zoo.PROFILES["demo"], tmp_path, metrics, multitask=multitask)
    assert "; before it (the first 500 examples of each val set): vqa_acc 0.83, itm_acc 0.72, in 8.0 min." in text
    assert "Training time 7.0 min (the retrieval stage)." in text and "| retrieval_t2i_R@1 | 0.74 |" in text
    assert "stalled" not in text
    restarted = {**multitask, "lead_restarts": 1, "config": {"seed": 1}}
    assert "Its lead phase stalled 1 time(s) (loss still on its plateau at the lead's end): the run started again with " \
           "seed 1." in card(training.zoo.PROFILES["demo"], tmp_path, metrics, multitask=restarted)


@pytest.mark.parametrize("force", [False, True])
def test_a_forced_build_does_not_resume_an_interrupted_one(tmp_path, monkeypatch, force):
    """Without --force an interrupted build resumes each run from its train_state.pt; --force starts every run over."""
    from training.finetune import STATE

    out = tmp_path / "zoo" / "demo"
    for run in ("multitask", "encoder"):
        (out / run).mkdir(parents=True)
        (out / run / STATE).write_bytes(b"an interrupted run's state")
    (out / "detector").mkdir()
    (out / "detector" / "manifest.json").write_text("{}")
    resumed = {}

    def train(cfg, data=None, progress=True):
        resumed[cfg.out.name] = (cfg.out / STATE).exists()
        (cfg.out / "metrics.json").write_text(json.dumps({"final": {}, "train_seconds": 1}))
        return {"final": {}, "train_seconds": 1}

    monkeypatch.setattr(training.zoo, "train_detector", lambda *a, **k: None)
    monkeypatch.setattr(training.zoo, "run_data", lambda *a, **k: None)
    monkeypatch.setattr(training.zoo, "train", train)
    monkeypatch.setattr(training.zoo, "model_card", lambda *a, **k: "card")
    training.zoo.build_zoo("demo", root=tmp_path, force=force, progress=False)
    assert resumed == {"multitask": not force, "encoder": not force}


def test_the_build_runs_the_recipe_on_the_asked_device(tmp_path, monkeypatch):
    class Stop(Exception):
        pass

    seen = {}

    def train_detector(cfg, progress=True):
        seen["detector"] = cfg
        raise Stop  # the config is all this test reads

    monkeypatch.setattr(training.zoo, "train_detector", train_detector)
    with pytest.raises(Stop):
        training.zoo.build_zoo("demo", tmp_path, force=True, progress=False, threads=3)
    expected = replace(training.zoo.PROFILES["demo"]["detector"], out=tmp_path / "zoo" / "demo" / "detector", threads=3)
    assert seen["detector"] == expected


SMALL = ShapesConfig(world=WorldConfig(seed=3, height=64, width=64), splits=(("train", 24), ("val", 12)))
TINY_DETECTOR = DetectorTrainConfig(out=Path("detector"), steps=2, batch_size=2, warmup=1, eval_every=2, eval_images=2,
                                    final_eval_images=4, data=SMALL,
                                    detector={"min_size": 64, "max_size": 64, "rpn_pre_nms_top_n": 50,
                                              "rpn_post_nms_top_n": 20, "num_boxes": 4})
TINY_RUN = FinetuneConfig(out=Path("multitask"), detector_dir=Path("detector"), preset="u-visualbert", size="tiny",
                          init_text=False, easy_vqa=False, train_scenes=24, eval_scenes=12, steps=4, batch_size=4, warmup=1,
                          tasks={"vqa": 1.0, "refer": 1.0, "itm": 1.0}, eval_every=4, eval_examples=8, final_eval_examples=8)
TINY = {"detector": TINY_DETECTOR, "finetune": TINY_RUN,
        "retrieval": replace(TINY_RUN, out=Path("encoder"), init_from=Path("multitask"), steps=3,
                             tasks={**TINY_RUN.tasks, "itm_rank": 1.0}, retrieval_queries=4)}


def weights(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def use_tiny_recipe(monkeypatch, tmp_path: Path) -> None:
    """The tiny recipe as the profile "tiny", its scenes prepared small (the build's run_data reads the standard
    ones), the cache under tmp_path."""
    from training.vl_data import prepare_task_data

    def run_data(cfg, progress=True, *also):
        return prepare_task_data(cfg.detector_dir, cfg.train_scenes, cfg.eval_scenes, easy_vqa=False, progress=False,
                                 data=SMALL, ranking=True)

    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(training.zoo.PROFILES, "tiny", TINY)
    monkeypatch.setattr(training.zoo, "run_data", run_data)


def test_the_same_recipe_and_seed_build_the_same_weights_to_the_bit(tmp_path, monkeypatch):
    """A tiny recipe built twice from scratch: the detector and the encoder are the same bytes."""
    use_tiny_recipe(monkeypatch, tmp_path)
    built = [training.zoo.build_zoo("tiny", tmp_path / name, threads=1, progress=False) for name in ("a", "b")]
    assert [weights(b / "detector") for b in built] == [weights(built[0] / "detector")] * 2
    assert weights(built[0] / "encoder") == weights(built[1] / "encoder")
    assert weights(built[0] / "multitask") == weights(built[1] / "multitask")
    assert "Then a retrieval stage of 3 steps" in (built[0] / "MODEL_CARD.md").read_text()
    monkeypatch.setitem(training.zoo.PROFILES, "tiny", with_runs(TINY, seed=1))  # the hashes do tell runs apart
    reseeded = training.zoo.build_zoo("tiny", tmp_path / "c", threads=1, progress=False)
    assert weights(reseeded / "detector") == weights(built[0] / "detector")
    assert weights(reseeded / "encoder") != weights(built[0] / "encoder")


class Interrupted(Exception):
    pass


def test_an_interrupted_forced_rebuild_never_leaves_a_set_that_looks_built(tmp_path, monkeypatch):
    """--force on a built set, interrupted after its new detector: the set is not built (no card, no encoder of that
    detector), and a plain build then trains every run again on the new detector's regions."""
    use_tiny_recipe(monkeypatch, tmp_path)
    out = training.zoo.build_zoo("tiny", tmp_path / "set", threads=1, progress=False)
    assert training.zoo.is_built(out)
    train = training.zoo.train
    monkeypatch.setitem(training.zoo.PROFILES, "tiny", {**TINY, "detector": replace(TINY_DETECTOR, seed=1)})

    def interrupted(cfg, *args, **kwargs):
        raise Interrupted

    monkeypatch.setattr(training.zoo, "train", interrupted)
    with pytest.raises(Interrupted):
        training.zoo.build_zoo("tiny", tmp_path / "set", force=True, threads=1, progress=False)
    assert not training.zoo.is_built(out)
    monkeypatch.setattr(training.zoo, "train", train)
    training.zoo.build_zoo("tiny", tmp_path / "set", threads=1, progress=False)
    fingerprint = training.zoo.detector_fingerprint(out / "detector")
    for run in ("multitask", "encoder"):
        assert json.loads((out / run / "manifest.json").read_text())["detector"]["fingerprint"] == fingerprint
    assert training.zoo.is_built(out)


def test_a_set_whose_encoder_is_of_another_detector_or_without_its_card_is_not_built(tmp_path, monkeypatch):
    """is_built: the card is there and the encoder was trained on the regions of the detector beside it. A set that
    lacks only its card gets it written again, without training."""
    use_tiny_recipe(monkeypatch, tmp_path)
    out = training.zoo.build_zoo("tiny", tmp_path / "set", threads=1, progress=False)
    card = (out / "MODEL_CARD.md").read_text()
    (out / "MODEL_CARD.md").unlink()
    assert not training.zoo.is_built(out)
    monkeypatch.setattr(training.zoo, "train", lambda *a, **k: pytest.fail("a finished run trained again"))
    monkeypatch.setattr(training.zoo, "train_detector", lambda *a, **k: pytest.fail("the detector trained again"))
    training.zoo.build_zoo("tiny", tmp_path / "set", threads=1, progress=False)
    assert training.zoo.is_built(out) and (out / "MODEL_CARD.md").read_text().split("\n")[3:] == card.split("\n")[3:]
    manifest = json.loads((out / "encoder" / "manifest.json").read_text())
    manifest["detector"]["fingerprint"] = "0" * 16  # an encoder of another detector's regions
    (out / "encoder" / "manifest.json").write_text(json.dumps(manifest))
    assert not training.zoo.is_built(out)


def test_a_read_only_zoo_directory_in_a_writable_root_exits_2_before_building(tmp_path, monkeypatch):
    import tempfile

    mkdtemp = tempfile.mkdtemp

    def refused_in_zoo(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).name == "zoo":
            raise PermissionError(13, "Permission denied")
        return mkdtemp(*args, dir=dir, **kwargs)

    (tmp_path / "zoo").mkdir()
    monkeypatch.setattr("tempfile.mkdtemp", refused_in_zoo)  # as a read-only zoo/ (root may write in any other)
    monkeypatch.setattr(training.zoo, "build_zoo", lambda *a, **k: pytest.fail("the build started"))
    result = runner.invoke(app, ["zoo", "build", "--root", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"error: model set {tmp_path / 'zoo' / 'demo'}: not a writable directory (cannot "
                             f"create it in {tmp_path / 'zoo'}: Permission denied)\n")


@pytest.mark.parametrize("error", ["training.finetune.TrainingError", "training.pretrain.PretrainConfigError"])
def test_a_run_that_cannot_go_on_exits_2_with_one_line(tmp_path, monkeypatch, error):
    """A diverged run, or a train_state.pt of another recipe's run (a recipe changed by an upgrade): as the train
    commands, one error line, exit 2."""
    import importlib

    module, name = error.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)

    def build_zoo(*args, **kwargs):
        raise cls("multitask/train_state.pt is from another run (--steps 600, not 500): delete it")

    monkeypatch.setattr(training.zoo, "build_zoo", build_zoo)
    result = runner.invoke(app, ["zoo", "build", "--root", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.stderr == "error: multitask/train_state.pt is from another run (--steps 600, not 500): delete it\n"


def test_the_build_minutes_of_the_help_texts_are_the_docs_figures():
    """`zoo build --help` and `serve --help` give the same minutes per model set, those of README.md, docs/RESULTS.md
    and docs/TRAINING.md (they said "about twice as long", "up to an hour", "about 14" and "about 30")."""
    from vlserve.commands.zoo import BUILD_MINUTES

    root = Path(__file__).parents[2]
    assert set(BUILD_MINUTES) == set(training.zoo.PROFILES)
    for command in (["zoo", "build", "--help"], ["serve", "--help"]):
        result = runner.invoke(app, command, env={"COLUMNS": "400"})
        text = " ".join(result.output.replace("│", " ").split())
        for profile, minutes in BUILD_MINUTES.items():
            assert f"{minutes} min" in text, (command, profile, text)
        assert "twice as long" not in text and "an hour" not in text and "about 14" not in text
    readme, results, training_doc = (root / name for name in ("README.md", "docs/RESULTS.md", "docs/TRAINING.md"))
    for profile, minutes in BUILD_MINUTES.items():
        assert f"| `{profile}` " in readme.read_text() and f"| {minutes} min |" in readme.read_text().split(
            f"| `{profile}` ", 1)[1].split("\n", 1)[0]
        row = results.read_text().split(f"| `{profile}` | ", 1)[1].split(" |", 1)[0]
        assert row.strip("*") == f"{minutes} min"
        assert f"`{profile}` ({minutes} min" in training_doc.read_text()


def test_a_build_that_fills_its_disk_exits_2_with_one_line_and_leaves_no_scenes(small_disk):
    """The writability check passes on a full disk; the build then failed with four tracebacks from its pool of
    scene writers, and each attempt left its half-written scenes to hold the space."""
    full_disk = small_disk("1m")
    result = runner.invoke(app, ["zoo", "build", "--root", str(full_disk), "--threads", "1"])
    assert result.exit_code == 2, result.output
    said = result.stderr.splitlines()  # the progress bar's line (redrawn after \r), then the error's
    assert said[-1].startswith(f"error: cannot build the demo model set into {full_disk / 'zoo' / 'demo'}: No space "
                               "left on device") and "Traceback" not in result.stderr
    assert [line for line in said if not line.startswith("shapes world:")] in ([said[-1]], ["", said[-1]])
    assert not [p for p in full_disk.rglob("*") if ".tmp-" in p.name]


def test_a_second_build_of_a_set_waits_for_the_first(tmp_path, monkeypatch, caplog):
    """Two builds of one set (two `make serve` at once) wrote over each other's training state and one failed after
    minutes of work: the second waits for the first's lock, then finds the set built and builds nothing."""
    import threading
    import time

    from models.feature_files import lock_for_writing

    out = training.zoo.zoo_dir("demo", tmp_path)
    out.parent.mkdir(parents=True)
    built = threading.Event()
    monkeypatch.setattr(training.zoo, "is_built", lambda path: built.is_set())
    builds = []
    monkeypatch.setattr(training.zoo, "_build", lambda *a: builds.append(a))
    with lock_for_writing(out.parent / f".{out.name}.build.lock"):  # the first build
        second = threading.Thread(target=training.zoo.build_zoo, args=("demo", tmp_path), kwargs={"progress": False})
        with caplog.at_level("WARNING", logger="training.zoo"):
            second.start()
            time.sleep(1.0)
            assert second.is_alive()  # waiting
        built.set()  # the first build ends with the set built
    second.join(timeout=10)
    assert not second.is_alive() and builds == []
    assert any("another build of" in r.getMessage() and "waiting" in r.getMessage() for r in caplog.records)


def test_sigterm_during_a_build_removes_its_half_written_scenes(tmp_path, monkeypatch):
    """SIGTERM (docker stop, a pod's end, `timeout`) while the scenes are written: the build unwinds as on Ctrl-C,
    removes them (a SIGTERMed build left its shapes/<hash>.tmp-<pid> of tens of MB for good) and ends by the signal."""
    import signal

    import training.data.shapes_cache as shapes_cache

    use_tiny_recipe(monkeypatch, tmp_path)

    def then_terminated(config, tmp, workers, progress):
        (tmp / "train").mkdir(parents=True)
        (tmp / "train" / "scene-0.png").write_bytes(b"\0" * 1024)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(shapes_cache, "_generate", then_terminated)
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        result = CliRunner().invoke(app, ["zoo", "build", "--profile", "tiny", "--root", str(tmp_path / "cache"),
                                          "--threads", "1"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert result.stderr.endswith("error: terminated (SIGTERM)\n") and received == [signal.SIGTERM]
    assert not [p for p in (tmp_path / "cache").rglob("*.tmp-*")]
