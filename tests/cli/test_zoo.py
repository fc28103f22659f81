"""`vlserve zoo build` options: --root moves every cache the build writes, unknown profiles exit 2."""
import dataclasses
import os

import pytest
from typer.testing import CliRunner

import training.zoo
from training.data.shapes_cache import cache_root
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


def test_demo_profile_reaches_the_finetune_config_and_the_card(tmp_path):
    import json

    p = training.zoo.PROFILES["demo"]
    cfg = training.zoo.finetune_config(p, tmp_path / "det", tmp_path / "enc")
    assert (cfg.preset, cfg.steps, cfg.dropout, cfg.bf16, cfg.vqa_pool) == ("u-visualbert", p.finetune_steps, 0.0, True, "regions_film")
    assert (cfg.itm_pool, cfg.nlvr2_pool) == ("regions", "regions")
    assert {"positions", "relations", "attributes"} <= set(cfg.tasks)
    assert training.zoo.detector_selection(p)["conf_thresh"] == 0.3  # the demo keeps the confident regions
    assert cfg.eval_every == cfg.steps  # the demo's encoder is evaluated once, at the end (its build time)
    full = training.zoo.PROFILES["full"]
    cfg = training.zoo.finetune_config(full, tmp_path, tmp_path)
    # the full profile trains the demo's recipe (the curriculum, then the retrieval stage) on all the data
    assert (cfg.itm_pool, cfg.nlvr2_pool, cfg.lead_tasks, cfg.lead_steps, cfg.steps) == ("regions", "regions", ("refer",), 200, 3_000)
    assert cfg.curriculum == p.curriculum and cfg.vqa_pool == "regions_film" and cfg.eval_every == cfg.steps
    assert (full.train_scenes, full.eval_scenes, full.easy_vqa_images, full.card_examples) == (20_000, 2_000, None, None)
    assert full.retrieval_steps > p.retrieval_steps and full.query_bank == p.query_bank
    (tmp_path / "det").mkdir()
    (tmp_path / "det" / "metrics.json").write_text(json.dumps({"val": {"map50": 0.98}, "fingerprint": "f" * 16}))
    card = training.zoo.model_card("demo", p, tmp_path / "det", {"final": {"vqa_acc": 0.75}, "train_seconds": 600,
                                                                  "train_precision": "bf16", "eval_precision": "bf16"},
                                   det_seconds=180, total_seconds=900)
    assert "dropout 0; metrics computed with bf16 GEMMs." in card and "| vqa_acc | 0.75 |" in card and "15.0 min" in card
    assert "bfloat16 autocast training, word embeddings frozen, normalized box embedding, dropout 0" in card
    fallback = training.zoo.model_card("demo", p, tmp_path / "det", {"final": {}, "train_seconds": 600, "train_precision": "fp32"},
                                       det_seconds=180, total_seconds=900)
    assert "float32 training (bf16 asked for; this CPU has no native bf16), word embeddings frozen" in fallback


def test_the_encoder_depth_reaches_the_finetune_config_and_the_card(tmp_path):
    import json

    (tmp_path / "metrics.json").write_text(json.dumps({"val": {"map50": 0.98}, "fingerprint": "f" * 16}))
    card = lambda p: training.zoo.model_card("demo", p, tmp_path, {"final": {}, "train_seconds": 60},  # noqa: E731
                                             det_seconds=60, total_seconds=120)
    four = dataclasses.replace(training.zoo.PROFILES["demo"], num_layers=4)
    six = dataclasses.replace(four, num_layers=None)
    assert training.zoo.finetune_config(four, tmp_path, tmp_path / "enc").num_layers == 4
    assert training.zoo.finetune_config(six, tmp_path, tmp_path / "enc").num_layers is None
    assert "(hidden 384, 4 layers, text side from the first 4 layers of the pretrained MiniLM-L6)" in card(four)
    assert "(hidden 384, 6 layers, text side from the pretrained MiniLM-L6)" in card(six)


def test_the_card_names_the_lead_phase(tmp_path):
    import json

    (tmp_path / "metrics.json").write_text(json.dumps({"val": {"map50": 0.98}, "fingerprint": "f" * 16}))
    card = training.zoo.model_card("full", training.zoo.PROFILES["full"], tmp_path, {"final": {}, "train_seconds": 60},
                                   det_seconds=60, total_seconds=120)
    assert "trained together for 3000 steps (the first 200 on refer alone, then 400 on vqa + refer + itm + nlvr2" in card
    assert "ITM from regions, NLVR2 from regions" in card
    assert "Then a retrieval stage of 4000 steps (the first 300 on the ranking sets alone)" in card
    assert "retrieval: text -> image over the first 1000 val scenes) | value |" in card
    demo = training.zoo.model_card("demo", training.zoo.PROFILES["demo"], tmp_path, {"final": {}, "train_seconds": 60},
                                   det_seconds=60, total_seconds=120)
    assert ("trained together for 1400 steps (the first 200 on refer alone, then 400 on vqa + refer + itm + nlvr2 alone, "
            "then 400 on positions_one_side + vqa alone, then 300 on positions + vqa alone)") in demo
    assert ("; the mix also draws the positions set (weight 0.5, through the vqa head), the relations set (weight 0.5, "
            "through the vqa head) and the attributes set (weight 0.5, through the vqa head).") in demo
    assert "normalized box embedding" in demo
    phased = dataclasses.replace(training.zoo.PROFILES["demo"], lead_tasks=("refer",), lead_steps=200,
                                 curriculum=((200, ("positions_one_side",)), (100, ("positions", "refer"))),
                                 extra_tasks=(("positions", 0.25),))
    cfg = training.zoo.finetune_config(phased, tmp_path, tmp_path)
    assert cfg.curriculum == phased.curriculum and cfg.tasks["positions"] == 0.25 and cfg.tasks["vqa"] == 1.0
    card = training.zoo.model_card("demo", phased, tmp_path, {"final": {}, "train_seconds": 60}, det_seconds=60,
                                   total_seconds=120)
    assert ("(the first 200 on refer alone, then 200 on positions_one_side alone, then 100 on positions + refer alone)"
            in card)
    assert "; the mix also draws the positions set (weight 0.25, through the vqa head)." in card


def test_a_pretraining_stage_feeds_the_finetuning_and_the_card(tmp_path):
    import json

    (tmp_path / "metrics.json").write_text(json.dumps({"val": {"map50": 0.98}, "fingerprint": "f" * 16}))
    demo = training.zoo.PROFILES["demo"]
    assert demo.pretrain_steps == 0 and training.zoo.finetune_config(demo, tmp_path, tmp_path / "enc").init_from is None
    p = dataclasses.replace(demo, pretrain_steps=1500)
    pre = training.zoo.pretrain_config(p, tmp_path / "det", tmp_path / "pretrained", threads=1)
    assert (pre.preset, pre.box_embedding, pre.steps, pre.objectives) == ("u-visualbert", "normalized", 1500, ("mlm", "itm"))
    assert (pre.mlm_words, pre.mlm_matched_only, pre.mask_prob, pre.easy_vqa, pre.train_scenes) == ("grounded", True, 0.5, False, 3000)
    assert training.zoo.finetune_config(p, tmp_path, tmp_path / "enc").init_from == tmp_path / "pretrained"
    pretrained = {"train_seconds": 750, "final": {"itm_acc": 0.5, "mlm_grounded_acc": 0.7625, "mlm_grounded_acc_other_image": 0.5656}}
    card = training.zoo.model_card("demo", p, tmp_path, {"final": {}, "train_seconds": 60}, det_seconds=60,
                                   total_seconds=120, pretrained=pretrained)
    assert ("Pretrained first for 1500 steps (mlm + itm; masked LM of the detector's class and attribute words only, on "
            "matched pairs only, mask rate 0.5) on the same scenes' captions in 12.5 min; masked class and attribute words "
            "recovered 0.762 with the caption's image, 0.566 with another; fine-tuning starts from that encoder.") in card
    assert "No pretraining stage" in training.zoo.model_card("demo", demo, tmp_path, {"final": {}, "train_seconds": 60},
                                                              det_seconds=60, total_seconds=120)


def test_the_pretrained_profile_is_the_demo_after_a_grounded_pretraining(tmp_path):
    demo, pretrained = training.zoo.PROFILES["demo"], training.zoo.PROFILES["pretrained"]
    assert dataclasses.replace(pretrained, pretrain_steps=0) == demo
    assert pretrained.pretrain_steps == 1500 and pretrained.num_layers == demo.num_layers == 4
    pre = training.zoo.pretrain_config(pretrained, tmp_path / "det", tmp_path / "zoo" / "pretrained")
    assert pre.num_layers == 4  # pretraining builds the encoder the fine-tuning continues (same depth)
    cfg = training.zoo.finetune_config(pretrained, tmp_path / "det", tmp_path / "zoo" / "encoder")
    # the demo's multi-task run, then its retrieval stage, from the pretrained encoder
    assert cfg.init_from == tmp_path / "zoo" / "pretrained" and cfg.steps == demo.finetune_steps
    assert cfg.retrieval_queries == 0 and pretrained.retrieval_steps == demo.retrieval_steps


def test_a_retrieval_stage_goes_on_the_card(tmp_path):
    import json

    (tmp_path / "metrics.json").write_text(json.dumps({"val": {"map50": 0.98}, "fingerprint": "f" * 16}))
    p = dataclasses.replace(training.zoo.PROFILES["demo"], retrieval_steps=1200, query_bank=64, query_bank_temperature=2.0,
                            retrieval_lead_steps=0)
    first = training.zoo.finetune_config(p, tmp_path, tmp_path / "multitask")
    assert first.retrieval_queries == 0 and first.query_bank == 0  # scored after the stage
    assert first.final_eval_examples == training.zoo.BEFORE_STAGE_EXAMPLES  # only the card's "before it"
    stage = training.zoo.retrieval_config(p, first, tmp_path / "encoder")
    assert (stage.final_eval_examples, stage.query_bank, stage.query_bank_temperature) == (p.card_examples, 64, 2.0)
    assert p.card_examples == 2000  # the card's accuracies: the first 2,000 examples of each set
    whole = training.zoo.retrieval_config(dataclasses.replace(p, card_examples=None), first, tmp_path / "encoder")
    assert whole.final_eval_examples is None
    multitask = {"train_seconds": 480, "final": {"vqa_acc": 0.83, "itm_acc": 0.72, "vqa_acc_number": 0.71}}
    metrics = {"final": {"vqa_acc": 0.84, "retrieval_t2i_R@1": 0.74}, "train_seconds": 420}
    card = training.zoo.model_card("demo", p, tmp_path, metrics, det_seconds=60, total_seconds=1200, multitask=multitask)
    assert "Then a retrieval stage of 1200 steps from that checkpoint (every head kept)" in card
    assert "The encoder keeps 64 listing captions of the training scenes as its query bank" in card
    assert "temperature 2; retrieval_t2i_raw_R@1: the raw scores)" in card
    assert "; before it (the first 500 examples of each val set): vqa_acc 0.83, itm_acc 0.72, in 8.0 min." in card
    assert (stage.lead_tasks, stage.lead_steps) == ((), 0)  # no ranking lead unless the profile asks
    led = dataclasses.replace(p, retrieval_lead_steps=300)
    stage = training.zoo.retrieval_config(led, first, tmp_path / "encoder")
    assert (stage.lead_tasks, stage.lead_steps) == (("itm_rank", "itm_rank_text"), 300)
    assert "Then a retrieval stage of 1200 steps (the first 300 on the ranking sets alone) from that checkpoint" in \
        training.zoo.model_card("demo", led, tmp_path, metrics, det_seconds=60, total_seconds=1200, multitask=multitask)
    assert "Training time 7.0 min (the retrieval stage)." in card and "| retrieval_t2i_R@1 | 0.74 |" in card
    assert (first.lead_retries, stage.lead_retries) == (2, 0) and "stalled" not in card  # the multi-task run's lead only
    restarted = {**multitask, "lead_restarts": 1, "config": {"seed": 1}}
    assert "Its lead phase stalled 1 time(s) (loss still on its plateau at the lead's end): the run started again with " \
           "seed 1." in training.zoo.model_card("demo", p, tmp_path, metrics, 60, 1200, multitask=restarted)
    assert training.zoo.PROFILES["demo"].retrieval_steps == 1800
    plain = dataclasses.replace(training.zoo.PROFILES["pretrained"], retrieval_steps=0)  # its one run scores retrieval
    assert "retrieval stage" not in training.zoo.model_card("pretrained", plain, tmp_path, {"final": {}, "train_seconds": 60},
                                                            det_seconds=60, total_seconds=120)
    assert training.zoo.finetune_config(plain, tmp_path, tmp_path).retrieval_queries == 100


def test_adaptive_region_selection_reaches_the_detector_config_and_the_card(tmp_path):
    """region_conf: the detector keeps the regions at or above that confidence, 1 to num_boxes of them (bottom-up
    attention's adaptive mode); without it, always the num_boxes most confident."""
    import json

    from models.detector import DetectorConfig

    fixed = dataclasses.replace(training.zoo.PROFILES["demo"], region_conf=None)
    assert training.zoo.detector_selection(fixed) == {"num_boxes": 8, "rpn_post_nms_top_n": 100}
    adaptive = dataclasses.replace(fixed, region_conf=0.3)
    cfg = DetectorConfig(classes=["circle"], **training.zoo.detector_selection(adaptive))
    assert (cfg.adaptive, cfg.min_boxes, cfg.max_boxes, cfg.conf_thresh, cfg.max_regions) == (True, 1, 8, 0.3, 8)
    (tmp_path / "det").mkdir()
    (tmp_path / "det" / "metrics.json").write_text(json.dumps({"val": {"map50": 0.98}, "fingerprint": "f" * 16}))
    card = lambda p: training.zoo.model_card("demo", p, tmp_path / "det", {"final": {}, "train_seconds": 60},  # noqa: E731
                                             det_seconds=60, total_seconds=120)
    assert "the regions with confidence >= 0.3 (1 to 8 per image)" in card(adaptive)
    assert "8 regions per image" in card(fixed)


def test_a_ranking_head_reaches_the_finetune_config_and_the_card(tmp_path):
    """rank_pool: the retrieval stage's ranking sets train a head of their own (models.config.RANK_HEAD), which the
    card lists and describes; without it they train the itm head."""
    import json

    from models import RANK_HEAD

    (tmp_path / "metrics.json").write_text(json.dumps({"val": {"map50": 0.98}, "fingerprint": "f" * 16}))
    ranked = dataclasses.replace(training.zoo.PROFILES["demo"], rank_pool="pooled")
    shared = dataclasses.replace(ranked, rank_pool=None)
    multitask = training.zoo.finetune_config(ranked, tmp_path, tmp_path / "multitask")
    stage = training.zoo.retrieval_config(ranked, multitask, tmp_path / "encoder")
    assert (multitask.rank_pool, stage.rank_pool) == ("pooled", "pooled")
    card = lambda p: training.zoo.model_card("demo", p, tmp_path, {"final": {}, "train_seconds": 60},  # noqa: E731
                                             det_seconds=60, total_seconds=120)
    assert f"heads\nvqa, refer, itm, nlvr2, {RANK_HEAD}, trained together" in card(ranked)
    assert (f"listwise plus pairwise cross-entropy through a ranking head of their own ({RANK_HEAD}, reading pooled; "
            "/retrieve ranks with it).") in card(ranked)
    assert ("(every head kept): the mix (with vqa at 3, nlvr2 at 4, relations at 1.5 (through the vqa head), attributes at 1.5 "
            "(through the vqa head), related_attributes at 3 (through the vqa head) and related_refer at 2 (through the "
            "refer head)) plus ranking groups at weight 6 each") in card(ranked)
    assert (stage.tasks["related_attributes"], stage.tasks["related_refer"]) == (3.0, 2.0)
    assert not {"related_attributes", "related_refer"} & set(multitask.tasks)
    assert (stage.tasks["relations"], stage.tasks["attributes"], stage.tasks["itm_rank"]) == (1.5, 1.5, 6.0)
    assert (stage.tasks["vqa"], stage.tasks["nlvr2"], stage.tasks["refer"]) == (3.0, 4.0, 1.0)
    assert (multitask.tasks["relations"], multitask.tasks["attributes"]) == (0.5, 0.5)  # the multi-task run keeps its own
    assert "heads\nvqa, refer, itm, nlvr2, trained together" in card(shared)
    assert "listwise cross-entropy through the itm head." in card(shared)


@pytest.mark.parametrize("force", [False, True])
def test_a_forced_build_does_not_resume_an_interrupted_one(tmp_path, monkeypatch, force):
    """Without --force an interrupted build resumes each run from its train_state.pt; --force starts every run over."""
    import json

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


def test_the_detector_attribute_weight_and_the_seed_reach_the_build_and_the_card(tmp_path, monkeypatch):
    import json

    class Stop(Exception):
        pass

    seen = {}

    def train_detector(cfg, progress=True):
        seen["detector"] = cfg
        raise Stop  # the configs are all this test reads

    p = dataclasses.replace(training.zoo.PROFILES["demo"], detector_attribute_weight=4.0, seed=2)
    monkeypatch.setattr(training.zoo, "train_detector", train_detector)
    monkeypatch.setitem(training.zoo.PROFILES, "weighted", p)
    with pytest.raises(Stop):
        training.zoo.build_zoo("weighted", tmp_path, force=True, progress=False)
    assert (seen["detector"].attribute_weight, seen["detector"].device) == (4.0, "cpu")
    cfg = training.zoo.finetune_config(p, tmp_path / "det", tmp_path / "enc")
    assert cfg.seed == 2 and training.zoo.retrieval_config(p, cfg, tmp_path / "stage").seed == 2
    (tmp_path / "det").mkdir()
    (tmp_path / "det" / "metrics.json").write_text(json.dumps({"val": {"map50": 0.98}, "fingerprint": "f" * 16}))
    card = lambda q: training.zoo.model_card("demo", q, tmp_path / "det", {"final": {}, "train_seconds": 60},  # noqa: E731
                                             det_seconds=60, total_seconds=120)
    assert "attributes: 8 colours, 2 sizes, their loss weighted 4)" in card(p)
    assert "weighted" not in card(dataclasses.replace(p, detector_attribute_weight=1.0))
