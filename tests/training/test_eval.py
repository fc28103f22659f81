"""`vlserve eval encoder`: every metric of a tiny fine-tuned checkpoint, zero-shot retrieval from an ITM-only one,
the same numbers as training's own evaluation, and exit 2 on bad input."""
import json
import shutil
import sys

import pytest
import torch
from typer.testing import CliRunner

from models import HeadConfig, create_model
from models.checkpoint import load_checkpoint, save_checkpoint
from models.detector import DetectorConfig, RegionDetector
from models.detector.io import save_detector
from models.tokenizer import VLTokenizer
from training.data.shapes_cache import ShapesConfig, dataset_dir
from training.finetune import TASKS, FinetuneConfig, train
from training.vl_data import prepare_task_data
from vlserve.cli import app

SHAPES = ShapesConfig(splits=(("train", 40), ("val", 10), ("test", 30)))
TASK_METRICS = {"vqa_acc", "refer_acc", "itm_acc", "nlvr2_acc", "mc_acc"}


def detector_config(**kw) -> DetectorConfig:
    base = dict(classes=["circle", "rectangle", "triangle"], attributes=["red"], min_size=64, max_size=128,
                rpn_pre_nms_top_n=100, rpn_post_nms_top_n=30, num_boxes=8, feature_dim=16)
    return DetectorConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny detector, a tiny visualbert fine-tuned for a few steps on all five tasks, and an ITM-only checkpoint."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLSERVE_CACHE", str(root))  # regions and shapes scenes stay in this test's directory
        torch.manual_seed(0)
        save_detector(RegionDetector(detector_config()), root / "detector")
        data = prepare_task_data(root / "detector", 40, 10, easy_vqa=False, progress=False, data=SHAPES)
        cfg = FinetuneConfig(out=root / "encoder", detector_dir=root / "detector", preset="visualbert", size="tiny",
                             init_text=False, tasks=dict.fromkeys(TASKS, 1.0), steps=10, batch_size=8, eval_every=10_000,
                             threads=1)
        final = train(cfg, data=data, progress=False)["final"]
        itm_only = create_model("visualbert", "tiny", heads={"itm": HeadConfig(kind="itm"), "mlm": HeadConfig(kind="mlm")},
                                visual_feat_dim=16)  # what a pretraining run leaves: no task heads
        save_checkpoint(itm_only, root / "pretrained", VLTokenizer.pretrained_minilm(max_length=40))
        yield root, final


def evaluate(root, *args, checkpoint="encoder", detector="detector"):
    argv = ["eval", "encoder", str(root / checkpoint), "--detector-dir", str(root / detector),
            "--shapes-dir", str(dataset_dir(SHAPES, root)), "--threads", "1", *map(str, args)]
    return CliRunner().invoke(app, argv)


def test_every_metric_of_a_finetuned_checkpoint(trained):
    root, _ = trained
    result = evaluate(root, "--scenes", 20, "--easy-vqa-images", 2, "--retrieval-pool", 25, "--retrieval-queries", 5)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["split"] == "test" and set(report["heads"]) == set(TASKS)
    assert TASK_METRICS | {"easy_vqa_acc"} <= set(report)
    assert all(0.0 <= report[k] <= 1.0 for k in TASK_METRICS | {"easy_vqa_acc"})
    retrieval = report["retrieval"]
    assert retrieval["pool"] == 25 and retrieval["queries"] == 5
    for direction in ("text_to_image", "image_to_text"):
        recall = retrieval[direction]
        assert list(recall) == ["R@1", "R@5", "R@10"] and recall["R@1"] <= recall["R@5"] <= recall["R@10"]


def test_a_checkpoint_of_fewer_text_positions_than_its_tokenizer_cuts_is_evaluated(trained):
    """An imported checkpoint may place fewer text positions than its tokenizer's max_length: rows were padded past
    its position table (a traceback); its texts are cut to its positions, as the service cuts them, and it says so."""
    root, _ = trained
    short = create_model("visualbert", "tiny", heads={"itm": HeadConfig(kind="itm")}, visual_feat_dim=16,
                         max_position_embeddings=24)
    save_checkpoint(short, root / "short", VLTokenizer.pretrained_minilm(max_length=40))
    result = evaluate(root, "--scenes", 10, "--easy-vqa-images", 0, "--retrieval-pool", 10, "--retrieval-queries", 3,
                      checkpoint="short")
    assert result.exit_code == 0, result.output
    assert "note: texts are cut to the 24 text positions" in result.stderr
    assert 0.0 <= json.loads(result.stdout)["itm_acc"] <= 1.0


def test_a_checkpoint_with_a_query_bank_ranks_text_to_image_by_it(trained):
    """The bank in labels.json: text -> image ranks the bank-normalised scores; the raw scores' R@K (reported beside
    them) are those of the same weights without a bank; image -> text is unchanged."""
    from models.query_bank import BANK_KEY

    root, _ = trained
    plain = load_checkpoint(root / "pretrained")
    bank = {"texts": ["a red circle", "a rectangle and a triangle", "two red triangles", "a circle"], "temperature": 0.5}
    save_checkpoint(plain.model, root / "banked", plain.tokenizer, labels={BANK_KEY: bank})
    args = ("--scenes", 10, "--easy-vqa-images", 0, "--retrieval-pool", 20, "--retrieval-queries", 20)
    without, banked = (json.loads(evaluate(root, *args, checkpoint=c).stdout)["retrieval"] for c in ("pretrained", "banked"))
    assert banked["query_bank"] == {"captions": 4, "temperature": 0.5} and "query_bank" not in without
    assert banked["text_to_image_raw"] == without["text_to_image"] and banked["image_to_text"] == without["image_to_text"]
    assert "text_to_image_raw" not in without


def test_val_numbers_are_those_training_reported(trained):
    root, final = trained
    result = evaluate(root, "--split", "val", "--scenes", 10, "--easy-vqa-images", 0, "--retrieval-pool", 0)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {k: report[k] for k in final} == final
    assert {k for k in final if not k.startswith("vqa_acc_")} == TASK_METRICS  # and VQA per answer type
    assert {k for k in final if k.startswith("vqa_acc_")} <= {"vqa_acc_yes_no", "vqa_acc_number", "vqa_acc_other"}
    assert "retrieval" not in report and "easy_vqa_acc" not in report


def test_a_vqa_head_that_knows_fewer_answers_than_the_data_is_scored_over_its_own_list(trained, tmp_path):
    """A checkpoint's VQA head may list fewer answers (labels.json) than the eval data's answer ids reach: each
    prediction is read through the head's list, and a gold answer the head does not know scores 0."""
    from collections import Counter

    from training.vl_data import prepare_eval_data, shapes_config_from_dir

    root, _ = trained
    data, shapes_root = shapes_config_from_dir(dataset_dir(SHAPES, root))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLSERVE_CACHE", str(root))
        eval_data = prepare_eval_data(root / "detector", "val", 10, 0, 0, data=data, shapes_root=shapes_root)
    gold = [eval_data.answers[e.label] for e in eval_data.eval["vqa"]]
    common = Counter(gold).most_common(1)[0][0]
    known = [a for a in eval_data.answers if a != common][:2] + [common]  # the head always answers its last column
    assert max(e.label for e in eval_data.eval["vqa"]) >= len(known)  # gold ids past the head's columns
    model = create_model("visualbert", "tiny", heads={"vqa": HeadConfig(kind="vqa", num_labels=len(known))},
                         visual_feat_dim=16)
    with torch.no_grad():
        model.heads["vqa"].cls[-1].weight.zero_()
        model.heads["vqa"].cls[-1].bias.copy_(torch.tensor([0.0, 0.0, 1.0]))
    save_checkpoint(model, tmp_path / "small-vqa", VLTokenizer.pretrained_minilm(max_length=40),
                    labels={"heads": {"vqa": known}})
    result = evaluate(root, "--split", "val", "--scenes", 10, "--easy-vqa-images", 0, "--retrieval-pool", 0,
                      checkpoint=tmp_path / "small-vqa")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["vqa_acc"] == round(gold.count(common) / len(gold), 4)


def test_zero_shot_retrieval_from_an_itm_only_checkpoint(trained):
    root, _ = trained
    result = evaluate(root, "--scenes", 10, "--easy-vqa-images", 0, "--retrieval-pool", 12, "--retrieval-queries", 12,
                      checkpoint="pretrained")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert "itm_acc" in report and not (TASK_METRICS - {"itm_acc"}) & set(report)
    assert report["retrieval"]["queries"] == 12 and set(report["retrieval"]["text_to_image"]) == {"R@1", "R@5", "R@10"}
    one_way = evaluate(root, "--scenes", 10, "--easy-vqa-images", 0, "--retrieval-pool", 12, "--retrieval-queries", 12,
                       "--retrieval-directions", "text-to-image", checkpoint="pretrained")
    assert one_way.exit_code == 0, one_way.output
    retrieval = json.loads(one_way.stdout)["retrieval"]
    assert retrieval["text_to_image"] == report["retrieval"]["text_to_image"] and "image_to_text" not in retrieval


def test_bf16_precision_is_what_the_card_reports_with(trained):
    """--precision bf16 evaluates with bfloat16 GEMMs (the card's and the service's default arithmetic here): the
    numbers are those of the same evaluation inside gemm_precision, and close to float32's; a CPU without fast
    bfloat16 refuses it."""
    from models.layers import cpu_bf16_unavailable
    from training.evaluate import evaluate_tasks
    from training.finetune import gemm_precision
    from training.vl_data import prepare_eval_data, shapes_config_from_dir

    root, _ = trained
    args = ("--split", "val", "--scenes", 10, "--easy-vqa-images", 0, "--retrieval-pool", 0)
    reason = cpu_bf16_unavailable()
    if reason is not None:  # a CPU without fast bfloat16: refused with the reason, not emulated slowly
        refused = evaluate(root, *args, "--precision", "bf16")
        assert refused.exit_code == 2 and reason in refused.stderr, refused.output
        return
    fp32, bf16 = (json.loads(evaluate(root, *args, "--precision", p).stdout) for p in ("fp32", "bf16"))
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16")
    ckpt = load_checkpoint(root / "encoder")
    data, shapes_root = shapes_config_from_dir(dataset_dir(SHAPES, root))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLSERVE_CACHE", str(root))
        eval_data = prepare_eval_data(root / "detector", "val", 10, 0, 0, data=data, shapes_root=shapes_root)
    with gemm_precision(ckpt.model, "bf16"):
        by_hand = evaluate_tasks(ckpt.model, eval_data, ckpt.tokenizer, head_answers=ckpt.labels.get("heads"))
    assert {k: bf16[k] for k in by_hand} == by_hand
    assert all(abs(bf16[k] - fp32[k]) <= 0.15 for k in by_hand)


def test_bad_inputs_exit_2(trained, tmp_path):
    root, _ = trained
    shutil.copytree(root / "encoder", tmp_path / "corrupt")
    weights = tmp_path / "corrupt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    torch.manual_seed(1)
    save_detector(RegionDetector(detector_config()), tmp_path / "other-detector")
    save_detector(RegionDetector(detector_config(feature_dim=8)), tmp_path / "narrow-detector")
    cases = [
        (evaluate(tmp_path, checkpoint="missing", detector="other-detector"), "checkpoint directory not found"),
        (evaluate(tmp_path, checkpoint="corrupt", detector="other-detector"), "does not match its sha256"),
        (evaluate(root, detector="missing"), "detector directory not found"),
        (evaluate(root, detector=tmp_path / "other-detector"), "was trained on regions of detector"),
        (evaluate(root, checkpoint="pretrained", detector=tmp_path / "narrow-detector"), "reads 16-d region features"),
        (evaluate(root, "--split", "train"), "--split must be val or test"),
        (evaluate(root, "--retrieval-directions", "sideways"), "--retrieval-directions must be one of"),
        (evaluate(root, "--precision", "fp16"), "--precision must be fp32 or bf16"),
        (evaluate(root, "--retrieval-pool", 1), "--retrieval-pool must be 0 (no retrieval) or at least 2"),
        (evaluate(root, "--device", "tpu"), "device 'tpu' unknown: choose cpu, cuda or cuda:N"),
        (evaluate(root, "--device", "cuda:7"), "device 'cuda:7': torch sees"),
        (CliRunner().invoke(app, ["eval", "encoder", str(root / "encoder"), "--detector-dir", str(root / "detector"),
                                  "--shapes-dir", str(tmp_path)]), "not a shapes-world dataset directory"),
    ]
    for result, message in cases:
        assert result.exit_code == 2 and message in result.stderr, (message, result.output)
    assert load_checkpoint(root / "encoder")  # the originals are untouched


def test_the_report_gives_the_scenes_it_scored(trained):
    """More --scenes than the split has: the report says how many were scored, not how many were asked for."""
    root, _ = trained
    test_scenes = dict(SHAPES.splits)["test"]
    result = evaluate(root, "--scenes", 99_999, "--easy-vqa-images", 0, "--retrieval-pool", 0)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["scenes"] == test_scenes < 99_999


def test_the_exported_accuracy_benchmark_evaluates_a_service_runtime_as_the_model(trained, monkeypatch):
    """benchmarks/exported_accuracy.py scores a service runtime through training.evaluate (GraphModel reads as a
    model): over the torch runtime in float32 it gives the model's own figures (within a near-tie's flip)."""
    from pathlib import Path

    from service.runtime.torch_runtime import TorchRuntime
    from training.evaluate import evaluate_tasks

    root, _ = trained
    monkeypatch.setenv("VLSERVE_CACHE", str(root))  # the fixture's regions, already extracted
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    for name in ("exported_accuracy", "encoder"):  # the script and the benchmark module it imports, not kept
        monkeypatch.delitem(sys.modules, name, raising=False)
    from exported_accuracy import GraphModel, agreement, table

    data = prepare_task_data(root / "detector", 40, 10, easy_vqa=False, progress=False, data=SHAPES)
    checkpoint = load_checkpoint(root / "encoder")
    graphs = GraphModel(TorchRuntime(load_checkpoint(root / "encoder"), threads=1, precision="fp32"),
                        checkpoint.model.config)
    got, want = (evaluate_tasks(m, data, checkpoint.tokenizer) for m in (graphs, checkpoint.model))
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) <= 0.05 for k in want), (got, want)
    agree = {"runtime": agreement(graphs, checkpoint.model, data, checkpoint.tokenizer)}
    assert set(agree["runtime"]) == {name for name in data.eval if f"{name}_acc" in want}
    lines, worst = table({"torch": want, "runtime": got}, agree, ["runtime"], data)
    assert len(lines) == 2 + len(agree["runtime"]) and worst["runtime"] <= 0  # one row per eval set, VQA's per type
    assert any(key.startswith("vqa_acc_") for key in want)  # figures by answer type, which are not eval sets
