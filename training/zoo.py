"""`make zoo` / `vlserve zoo build`: a model set (detector + multi-task encoder) built from a recipe, with its model card.

A recipe is data: its stages in the order they run (detector, pretrain, finetune, retrieval), each a run config.
Paths in a recipe are relative to the model set's directory; the card is rendered from the recipe.
The figures behind each choice are in docs/RESULTS.md (the recipe's levers, by topic).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from models import RANK_HEAD
from models.detector import DetectorConfig
from models.feature_files import FileLockedError, lock_for_writing
from models.registry import encoder_config

from .data.shapes_cache import cache_root
from .data.vl_tasks import RANK_GROUP, RANK_HARD, RANK_NEIGHBOURS
from .detector_train import DetectorTrainConfig, train_detector
from .finetune import (RANK_TASK, RANK_TASKS, RANK_TEXT_TASK, STATE, TRAINING_SETS, FinetuneConfig, detector_fingerprint,
                       head_of, run_data, train)
from .pretrain import PretrainConfig, pretrain

log = logging.getLogger(__name__)

Recipe = dict[str, Any]  # stage name (detector, pretrain, finetune, retrieval) -> its run config, in the order they run
MULTITASK = "multitask"  # a recipe with a retrieval stage keeps its multi-task checkpoint here (the stage's start)
BEFORE_STAGE_EXAMPLES = 500  # the multi-task checkpoint's final evaluation: examples per val set (the card's "before it")

# 200 steps, scored on 250 val scenes (for the build's time); the colour/size loss at 4x, so that regions tell red
# from brown; bottom-up attention's adaptive regions: those with confidence >= 0.3 (shapes scenes hold at most 6 objects)
DETECTOR = DetectorTrainConfig(out=Path("detector"), steps=200, eval_every=200, final_eval_images=250, attribute_weight=4.0,
                               detector={"num_boxes": 8, "rpn_post_nms_top_n": 100, "adaptive": True, "min_boxes": 1,
                                         "max_boxes": 8, "conf_thresh": 0.3})
# what the pretraining and fine-tuning runs share: MiniLM's first 4 layers (steps 1.2-1.4x faster, no task lower than
# with 6), bf16, VisualBERT's embeddings with normalised sin/cos box geometry (with the preset's own, published ones,
# seeds 2 and 3 rank lower: text -> image R@1 0.80 and 0.79 against 0.89 and 0.84; the other tasks within the seeds'
# spread: docs/RESULTS.md, "Recipe levers"), 3,000 training scenes
ENCODER = dict(detector_dir=Path("detector"), preset="u-visualbert", num_layers=4, bf16=True, embedding_style="vlserve",
               box_embedding="normalized", train_scenes=3_000, eval_scenes=500)
# the multi-task run: refer alone first (it ends the seed stalls), then the four-task mix, then one-sided and
# both-sided position questions beside VQA (past the exclusive-or plateau of relation questions), then the mix with
# every relation and attribute question in it; VQA reads counts and located boxes modulated by the question
# (regions_film), ITM and NLVR2 read the regions, the ranking sets train a head of their own; no dropout
MULTITASK_RUN = FinetuneConfig(
    **ENCODER, out=Path(MULTITASK), easy_vqa_images=1_000, steps=1_400, lr=2e-4, dropout=0.0, freeze_word_embeddings=True,
    tasks={"vqa": 1.0, "refer": 1.0, "itm": 1.0, "nlvr2": 1.0, "positions": 0.5, "relations": 0.5, "attributes": 0.5},
    lead_tasks=("refer",), lead_steps=200, lead_retries=2,
    curriculum=((400, ("vqa", "refer", "itm", "nlvr2")), (400, ("positions_one_side", "vqa")), (300, ("positions", "vqa"))),
    vqa_pool="regions_film", vqa_loss="ce", itm_pool="regions", nlvr2_pool="regions", rank_pool="pooled",
    eval_every=1_400, seed=2, retrieval_pool=250, final_eval_examples=BEFORE_STAGE_EXAMPLES)
# the retrieval stage, from the multi-task checkpoint with every head: its first 300 steps on the two ranking sets
# alone (a listing caption with its image and 7 others; an image with its listing and 7 near misses), then them at 6
# beside the mix, which also finishes NLVR2 and easy-VQA's negations and draws questions and expressions that name
# objects through a relation; the encoder keeps 256 training listings as its query bank (an inverted softmax at T=2)
RETRIEVAL_RUN = replace(
    MULTITASK_RUN, out=Path("encoder"), init_from=Path(MULTITASK), steps=1_800, warmup=50, lead_tasks=RANK_TASKS,
    lead_steps=300, lead_retries=0, curriculum=(), eval_every=1_800,
    tasks={**MULTITASK_RUN.tasks, "vqa": 3.0, "nlvr2": 4.0, "relations": 1.5, "attributes": 1.5, "related_attributes": 3.0,
           "related_refer": 2.0, RANK_TASK: 6.0, RANK_TEXT_TASK: 6.0},
    retrieval_queries=100, final_eval_examples=2_000, query_bank=256, query_bank_temperature=2.0)
# masked LM of the detector's words on matched pairs, and ITM, on the same scenes' captions
PRETRAIN = PretrainConfig(**ENCODER, out=Path("pretrained"), easy_vqa=False, steps=1_500, objectives=("mlm", "itm"),
                          mlm_words="grounded", mlm_matched_only=True, mask_prob=0.5, eval_examples=500)
# the full profile's runs: every training scene and easy-VQA image, R@K over 1,000 val images
FULL_DATA = dict(train_scenes=20_000, eval_scenes=2_000, easy_vqa_images=None, seed=0, retrieval_pool=1_000)

PROFILES: dict[str, Recipe] = {
    # CPU, about 10 minutes
    "demo": {"detector": DETECTOR, "finetune": MULTITASK_RUN, "retrieval": RETRIEVAL_RUN},
    # the demo after a grounded pretraining
    "pretrained": {"detector": DETECTOR, "pretrain": PRETRAIN, "finetune": replace(MULTITASK_RUN, init_from=PRETRAIN.out),
                   "retrieval": RETRIEVAL_RUN},
    # the demo's recipe on all the data, the card scoring every val example
    "full": {"detector": replace(DETECTOR, steps=800, eval_every=800, final_eval_images=None),
             "finetune": replace(MULTITASK_RUN, **FULL_DATA, steps=3_000, eval_every=3_000),
             "retrieval": replace(RETRIEVAL_RUN, **FULL_DATA, steps=4_000, eval_every=4_000, final_eval_examples=None)},
}


def placed(recipe: Recipe, root: Path, threads: int = 2, device: str = "cpu") -> Recipe:
    """The recipe's runs for a model set at root: relative paths under root, on `threads` and `device`."""
    def place(cfg):
        paths = {f.name: root / v for f in dataclasses.fields(cfg)
                 if isinstance(v := getattr(cfg, f.name), Path) and not v.is_absolute()}
        return replace(cfg, **paths, threads=threads, device=device)
    return {name: place(cfg) for name, cfg in recipe.items()}


def zoo_dir(profile: str, root: Path | None = None) -> Path:
    return Path(root or cache_root()) / "zoo" / profile


CARD = "MODEL_CARD.md"
MANIFEST = "manifest.json"


def trained_on_detector(run_out: Path, detector_dir: Path) -> bool:
    """run_out holds a finished checkpoint (its manifest, its metrics) of a run on the regions of the detector now at
    detector_dir (not of the one an earlier, interrupted build replaced)."""
    try:
        manifest = json.loads((run_out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    fingerprint = detector_fingerprint(detector_dir)
    return (fingerprint is not None and isinstance(manifest, dict) and (run_out / "metrics.json").exists()
            and (manifest.get("detector") or {}).get("fingerprint") == fingerprint)


def is_built(path: Path) -> bool:
    """A finished model set: the detector, the encoder trained on its regions, and the model card (written last)."""
    return (path / CARD).exists() and trained_on_detector(path / "encoder", path / "detector")


def unmark(recipe: Recipe, out: Path) -> None:
    """Before a forced rebuild: remove what marks the set and each of its runs finished (the card first, the
    detector's manifest last), so that an interrupted rebuild never leaves a set that looks built, nor a stage a
    later build would skip, nor a train_state.pt it would resume."""
    (out / CARD).unlink(missing_ok=True)
    for name in ("retrieval", "finetune", "pretrain", "detector"):
        if (run := recipe.get(name)) is not None:
            for marker in (STATE, "metrics.json", MANIFEST):
                (run.out / marker).unlink(missing_ok=True)


def trained_on(metrics: dict) -> str:
    """The card's note of a GPU build ("" on the CPU, where the profiles' times are measured)."""
    device = metrics.get("device", "cpu")
    return "" if device == "cpu" else f" (the encoder trained on {device})"


def build_zoo(profile: str = "demo", root: Path | None = None, force: bool = False, threads: int = 2, progress: bool = True,
              device: str = "cpu") -> Path:
    """Run the profile's recipe (detector, regions extracted once, pretraining, fine-tuning, retrieval stage); write
    MODEL_CARD.md. Skips the runs that are done."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    out = zoo_dir(profile, root)
    if is_built(out) and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with building(out):
        if is_built(out) and not force:  # built by the run this one waited for
            return out
        return _build(profile, out, force, threads, progress, device)


@contextmanager
def building(out: Path) -> Iterator[None]:
    """Hold the build lock of the set at `out` (a file beside it), waiting while another build holds it: two builds
    of one set (two `make serve` at once) wrote over each other's training state, and one failed after minutes of
    work. The lock is flock(2): a killed build leaves none behind."""
    lock = out.parent / f".{out.name}.build.lock"
    try:
        held = lock_for_writing(lock)
    except FileLockedError:
        log.warning("another build of %s is running; waiting for it to end", out)
        held = lock_for_writing(lock, wait=True)
    with held:
        yield


def _build(profile: str, out: Path, force: bool, threads: int, progress: bool, device: str) -> Path:
    recipe = placed(PROFILES[profile], out, threads, device)
    detector, pre, first, stage = (recipe.get(name) for name in ("detector", "pretrain", "finetune", "retrieval"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if force:  # a rebuild from scratch: nothing of the earlier set is finished, nor resumed, until rebuilt
        unmark(recipe, out)
    if not (detector.out / MANIFEST).exists():
        train_detector(detector, progress=progress)
    det_seconds = time.perf_counter() - started
    done = lambda run: trained_on_detector(run.out, detector.out) and not (run.out / STATE).exists()  # noqa: E731
    pretrained = None
    if pre is not None:
        if not done(pre):
            pretrain(pre, progress=progress)
        pretrained = json.loads((pre.out / "metrics.json").read_text())
    last = stage or first
    data = None if done(last) else run_data(first, progress, *([stage] if stage else []))  # one preparation for both
    multitask = None
    if stage:  # the multi-task run, then the retrieval stage from it
        if not done(first):
            train(first, data=data, progress=progress)
        multitask = json.loads((first.out / "metrics.json").read_text())
    # a finished last run whose card is missing: the card is written again from its recorded metrics
    metrics = json.loads((last.out / "metrics.json").read_text()) if done(last) else train(last, data=data, progress=progress)
    card = model_card(profile, recipe, metrics, det_seconds, time.perf_counter() - started, pretrained, multitask)
    (out / CARD).write_text(card)
    return out


def region_line(detector: DetectorTrainConfig) -> str:
    """The card's words on the regions per image."""
    chosen = detector.detector
    if not chosen.get("adaptive"):
        return f"{chosen.get('num_boxes', DetectorConfig.num_boxes)} regions per image"
    return (f"the regions with confidence >= {chosen['conf_thresh']:g} ({chosen['min_boxes']} to {chosen['max_boxes']} "
            "per image)")


def pretraining_line(pre: PretrainConfig | None, pretrained: dict | None) -> str:
    """The card's sentence on the pretraining stage."""
    if pre is None:
        return "No pretraining stage in this profile."
    words = {"grounded": "of the detector's class and attribute words only", "all": "of every word"}[pre.mlm_words]
    pairs = ", on matched pairs only" if pre.mlm_matched_only else ""
    line = (f"Pretrained first for {pre.steps} steps ({' + '.join(pre.objectives)}; masked LM {words}"
            f"{pairs}, mask rate {pre.mask_prob:g}) on the same scenes' captions")
    if pretrained:
        final = pretrained.get("final", {})
        line += f" in {pretrained['train_seconds'] / 60:.1f} min"
        if "mlm_grounded_acc" in final:
            line += (f"; masked class and attribute words recovered {final['mlm_grounded_acc']:.3f} with the caption's "
                     f"image, {final['mlm_grounded_acc_other_image']:.3f} with another")
    return line + "; fine-tuning starts from that encoder."


def ranking_objective(rank_pool: str | None) -> str:
    """The card's words on how the ranking sets are learnt."""
    if not rank_pool:
        return "listwise cross-entropy through the itm head"
    return (f"listwise plus pairwise cross-entropy through a ranking head of their own ({RANK_HEAD}, reading "
            f"{rank_pool}; /retrieve ranks with it)")


def and_list(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def retrieval_line(first: FinetuneConfig, stage: FinetuneConfig | None, multitask: dict | None) -> str:
    """The card's sentence on the retrieval stage: its weights where they differ from the multi-task run's."""
    if stage is None:
        return ""
    changed = [(t, w) for t, w in stage.tasks.items() if t not in RANK_TASKS and first.tasks.get(t) != w]
    weights = [f"{t} at {w:g}" + (f" (through the {head_of(t, stage.rank_pool)} head)" if t in TRAINING_SETS else "")
               for t, w in changed]
    mix = f" (with {and_list(weights)})" if weights else ""
    lead = f" (the first {stage.lead_steps} on the ranking sets alone)" if stage.lead_steps else ""
    line = (f" Then a retrieval stage of {stage.steps} steps{lead} from that checkpoint (every head kept): the mix{mix} plus "
            f"ranking groups at weight {stage.tasks[RANK_TASK]:g} each, a listing caption with its image and {RANK_GROUP - 1} "
            f"others ({RANK_HARD} of them from the {RANK_NEIGHBOURS} scenes that share most objects with it) and an image "
            f"with its listing and {RANK_GROUP - 1} false near misses (one attribute changed, an object left out or added), "
            f"{ranking_objective(stage.rank_pool)}")
    if stage.query_bank:
        line += (f". The encoder keeps {stage.query_bank} listing captions of the training scenes as its query bank: /retrieve "
                 f"and the card's R@K rank each image by its score's share among its scores with them (an inverted "
                 f"softmax, temperature {stage.query_bank_temperature:g}; retrieval_t2i_raw_R@1: the raw scores)")
    if multitask:
        before = multitask["final"]
        line += (f"; before it (the first {first.final_eval_examples} examples of each val set): "
                 f"{', '.join(f'{k} {v}' for k, v in before.items() if k.endswith('_acc'))}, "
                 f"in {multitask['train_seconds'] / 60:.1f} min")
    return line + "."


def text_side(cfg: FinetuneConfig) -> str:
    """The card's words on the encoder's depth and where its text side starts."""
    layers = encoder_config(cfg.preset, cfg.size, **({} if cfg.num_layers is None else {"num_layers": cfg.num_layers})).num_layers
    start = "the pretrained MiniLM-L6" if layers >= 6 else f"the first {layers} layers of the pretrained MiniLM-L6"
    return f"{layers} layers, text side from {start}"


def embedding_words(cfg: FinetuneConfig) -> str:
    """The card's words on how the encoder embeds regions (u-visualbert's embedding style, the box embedding)."""
    style = cfg.embedding_style or encoder_config(cfg.preset, cfg.size).embedding_style
    if style == "published":
        return "its authors' embeddings (layer-normalised features plus layer-normalised Linear(4, H) box)"
    return f"{cfg.box_embedding} box embedding"


def model_card(name: str, recipe: Recipe, metrics: dict, det_seconds: float, total_seconds: float,
               pretrained: dict | None = None, multitask: dict | None = None) -> str:
    """MODEL_CARD.md of a built recipe (`placed`): what each stage ran, and the final metrics."""
    detector, first, stage = recipe["detector"], recipe["finetune"], recipe.get("retrieval")
    last = stage or first
    det = json.loads((detector.out / "metrics.json").read_text())
    rows = "\n".join(f"| {k} | {v} |" for k, v in metrics["final"].items())
    vqa_objective = "softmax cross-entropy" if first.vqa_loss == "ce" else "soft-score BCE"
    phases = [(n, tasks) for n, tasks in ((first.lead_steps, first.lead_tasks), *first.curriculum) if n]
    lead = (" (the first " + ", then ".join(f"{n} on {' + '.join(tasks)} alone" for n, tasks in phases) + ")") if phases else ""
    sets = [f"the {t} set (weight {w:g}, through the {head_of(t, first.rank_pool)} head)"
            for t, w in first.tasks.items() if t in TRAINING_SETS]
    extra = f"; the mix also draws {and_list(sets)}" if sets else ""
    runs = [m for m in (multitask, metrics) if m]
    restarts = sum(m.get("lead_restarts", 0) for m in runs)
    stalled = (f" Its lead phase stalled {restarts} time(s) (loss still on its plateau at the lead's end): the run "
               f"started again with seed {runs[0]['config']['seed']}.") if restarts else ""
    weighted = f", their loss weighted {detector.attribute_weight:g}" if detector.attribute_weight != 1 else ""
    return f"""# vlserve model set `{name}`

Built by `vlserve zoo build --profile {name}` in {total_seconds / 60:.1f} min on this machine{trained_on(metrics)}.

## Detector
EfficientNet-Lite0 (ImageNet) + FPN Faster R-CNN, trained {detector.steps} steps (batch {detector.batch_size}) on shapes-world scenes
(3 shapes; attributes: 8 colours, 2 sizes{weighted}) in {det.get("train_seconds", det_seconds) / 60:.1f} min. Validation: {json.dumps(det["val"])}.
Fingerprint `{det["fingerprint"]}`.

## Encoder
`{first.preset}` size `{first.size}` (hidden 384, {text_side(first)}), one shared encoder with heads
vqa, refer, itm, nlvr2{f", {RANK_HEAD}" if first.rank_pool else ""}, trained together for {first.steps} steps{lead} (batch {first.batch_size}, encoder lr {first.lr:g}) on
{first.train_scenes} shapes-world scenes (VQA, referring expressions, captions with hard and random negatives, NLVR2
pairs) plus the easy-VQA training questions, {region_line(detector)}; objectives: {vqa_objective} (VQA,
read from {first.vqa_pool}; ITM from {first.itm_pool}, NLVR2 from {first.nlvr2_pool}), IoU>=0.5 soft-target cross-entropy (refer), cross-entropy (ITM, NLVR2){extra}.{retrieval_line(first, stage, multitask)}
{"bfloat16 autocast" if metrics.get("train_precision") == "bf16" else "float32"} training\
{" (bf16 asked for; this CPU has no native bf16)" if first.bf16 and metrics.get("train_precision") == "fp32" else ""}\
{", word embeddings frozen" if first.freeze_word_embeddings else ""}, {embedding_words(first)}\
{", detector class words as region tags" if first.region_tags else ""}, \
dropout {0.1 if first.dropout is None else first.dropout:g}; metrics computed with {metrics.get("eval_precision", "fp32")} GEMMs.{stalled}
{pretraining_line(recipe.get("pretrain"), pretrained)} Training time {metrics["train_seconds"] / 60:.1f} min\
{" (the retrieval stage)" if stage else ""}.

| metric (val / easy-VQA test{f", the first {last.final_eval_examples} examples of each" if last.final_eval_examples else ""}; retrieval: text -> image over the {f"first {last.retrieval_pool} " if last.retrieval_pool else ""}val scenes) | value |
|---|---|
{rows}
"""
