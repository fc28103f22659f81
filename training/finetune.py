"""`vlserve train finetune`: one shared encoder, several task heads (VQA, refer, ITM, NLVR2, multiple choice), trained
together, from scratch, from MiniLM's text side, or from a (pretraining) checkpoint."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from models import RANK_HEAD, HeadConfig, VLModel, create_model
from models.checkpoint import WEIGHTS, CheckpointError, load_checkpoint, load_state_strict, save_checkpoint
from models.layers import bf16_unavailable, cpu_has_native_bf16, set_cpu_gemm_dtype
from models.query_bank import BANK_KEY
from models.text_init import init_text_from_minilm
from models.tokenizer import VLTokenizer

from .data.vl_tasks import RANK_GROUP, collate
from .device import autocast, model_device, resolve_device, rng_state, set_rng_state, to_device
from .evaluate import evaluate_tasks
from .objectives import group_ranking_loss
from .run_config import FinetuneConfig, embedding_override
from .retrieval import card_metrics, evaluate_retrieval, training_bank
from .vl_data import EXPRESSION_SETS, QUESTION_SETS, TaskData, prepare_task_data, tagged

log = logging.getLogger(__name__)
STATE = "train_state.pt"  # resumable state, written beside the checkpoint files
TASKS = ("vqa", "refer", "itm", "nlvr2", "multiple_choice")  # heads fine-tuning trains
RANK_TASK = "itm_rank"  # retrieval groups trained with a listwise ranking loss through the itm head: a caption
RANK_TEXT_TASK = "itm_rank_text"  # with its image and others (itm_rank), or an image with its caption and near misses
RANK_TASKS = (RANK_TASK, RANK_TEXT_TASK)
# training sets beyond the heads' own tasks -> the head they train: the ranking groups, and the question sets of
# vl_data.QUESTION_SETS (one-object positions, "is the red circle on the left?", for a curriculum of the VQA head;
# every relation or attribute question of a scene), and the expression sets of vl_data.EXPRESSION_SETS (refer head)
TRAINING_SETS = {RANK_TASK: "itm", RANK_TEXT_TASK: "itm", **dict.fromkeys(QUESTION_SETS, "vqa"),
                 **dict.fromkeys(EXPRESSION_SETS, "refer")}


def head_of(task: str, rank_pool: str | None = None) -> str:
    """The head a training task trains: with a rank_pool (FinetuneConfig.rank_pool), the ranking sets train a
    ranking head of their own."""
    if task in RANK_TASKS and rank_pool:
        return RANK_HEAD
    return TRAINING_SETS.get(task, task)


def build_model(cfg: FinetuneConfig, feature_dim: int, num_answers: int) -> VLModel:
    heads = {
        "vqa": HeadConfig(kind="vqa", num_labels=num_answers, vqa_loss=cfg.vqa_loss, pool=cfg.vqa_pool),
        "refer": HeadConfig(kind="refer"),
        "itm": HeadConfig(kind="itm", pool=cfg.itm_pool),
        "nlvr2": HeadConfig(kind="nlvr2", nlvr2_mode="pair", pool=cfg.nlvr2_pool),
        "multiple_choice": HeadConfig(kind="multiple_choice"),
        RANK_HEAD: HeadConfig(kind="itm", pool=cfg.rank_pool or "pooled"),
    }
    overrides = {} if cfg.dropout is None else {"dropout": cfg.dropout, "attention_dropout": cfg.dropout}
    if cfg.num_layers is not None:
        overrides["num_layers"] = cfg.num_layers
    if cfg.box_embedding != "linear":
        overrides["box_embedding"] = cfg.box_embedding
    if cfg.region_tags:
        overrides["region_tags"] = True
    overrides.update(embedding_override(cfg))
    names = dict.fromkeys(head_of(t, cfg.rank_pool) for t in training_tasks(cfg))
    model = create_model(cfg.preset, cfg.size, heads={t: heads[t] for t in names}, visual_feat_dim=feature_dim,
                         feature_norm=cfg.feature_norm, **overrides)
    if cfg.init_from is not None:
        copied = init_from_checkpoint(model, cfg.init_from)
        log.info("encoder from %s; heads copied: %s", cfg.init_from, ", ".join(copied) or "none")
    elif cfg.init_text:
        init_text_from_minilm(model)
    return model


def train_precision(bf16: bool, device: torch.device | str = "cpu") -> str:
    """The precision a run trains in: bf16 autocast when asked for and the CPU computes bf16 dot products natively
    (or the GPU has bf16); float32 otherwise (oneDNN emulates bf16 on AVX2-only CPUs, several times slower per step
    than float32 there: benchmarks/train_step.py, docs/BENCHMARKS.md)."""
    device = torch.device(device)
    if bf16 and device.type == "cuda":
        reason = bf16_unavailable(device)
        if reason:
            log.warning("bf16 asked for, but %s: training in float32", reason)
        return "fp32" if reason else "bf16"
    if bf16 and not cpu_has_native_bf16():
        log.warning("bf16 asked for, but this CPU has no native bfloat16 (AVX512-BF16 or AMX): training in float32")
        return "fp32"
    return "bf16" if bf16 else "fp32"


def eval_precision(bf16: bool, device: torch.device | str = "cpu") -> str:
    """The precision evaluations run in: a bf16 run is evaluated with bfloat16 GEMMs where they are fast on this CPU
    (as the service's VLSERVE_PRECISION=auto then serves it, docs/BENCHMARKS.md), or in bfloat16 autocast on a GPU
    with bf16 (the service's `auto` there), float32 elsewhere."""
    return "bf16" if bf16 and bf16_unavailable(torch.device(device)) is None else "fp32"


@contextmanager
def gemm_precision(model: VLModel, precision: str):
    """Inference GEMMs of model in `precision` ("fp32" or "bf16") inside the block, float32 after it: the CPU's
    packed bfloat16 GEMMs, or bfloat16 autocast for a model on a GPU."""
    device = model_device(model)
    if device.type != "cpu":
        with autocast(precision == "bf16", device):
            yield
        return
    set_cpu_gemm_dtype(model, torch.bfloat16 if precision == "bf16" else torch.float32)
    try:
        yield
    finally:
        set_cpu_gemm_dtype(model, torch.float32)


def fit_feature_norm(model: VLModel, table) -> None:
    """Fit the encoder's region-feature standardisation on the training regions (no-op without one)."""
    if model.encoder.feature_norm is not None:
        model.encoder.feature_norm.fit(table.features, table.mask)


def init_from_checkpoint(model: VLModel, path: Path) -> list[str]:
    """Copy a checkpoint's encoder into model, and each head with the same name, kind and tensor shapes (the
    rest stay fresh); returns the copied heads. CheckpointError when preset, size, feature dim, box embedding, embedding
    style or depth differ."""
    enc = model.config.encoder
    source = load_checkpoint(path, preset=enc.preset, size=enc.size, visual_feat_dim=enc.visual_feat_dim).model
    for name in ("box_embedding", "embedding_style"):
        theirs, ours = getattr(source.config.encoder, name), getattr(enc, name)
        if theirs != ours:
            raise CheckpointError(f"{path}: encoder.{name} is {theirs!r}, expected {ours!r}")
    if source.config.encoder.num_layers != enc.num_layers:
        raise CheckpointError(f"{path}: encoder.num_layers is {source.config.encoder.num_layers}, expected {enc.num_layers}")
    load_state_strict(model.encoder, source.encoder.state_dict(), Path(path) / WEIGHTS)
    shapes = lambda module: {k: v.shape for k, v in module.state_dict().items()}  # noqa: E731
    copied = []
    for name, head in model.heads.items():
        theirs = source.heads[name] if name in source.heads else None
        if theirs is not None and source.config.heads[name].kind == model.config.heads[name].kind and shapes(theirs) == shapes(head):
            head.load_state_dict(theirs.state_dict())
            copied.append(name)
    return copied


def param_groups(model: VLModel, cfg: FinetuneConfig) -> list[dict]:
    """Encoder and heads at their own learning rates; no weight decay on biases and LayerNorms."""
    groups = {(h, d): [] for h in (False, True) for d in (False, True)}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups[(name.startswith("heads."), p.dim() > 1 and "LayerNorm" not in name)].append(p)
    return [
        {"params": ps, "peak_lr": cfg.head_lr if head else cfg.lr, "weight_decay": cfg.weight_decay if decay else 0.0}
        for (head, decay), ps in groups.items() if ps
    ]


def adamw(groups: list[dict], lr: float) -> torch.optim.AdamW:
    """AdamW, one fused update over all parameters: 1.11x per demo step against foreach (docs/BENCHMARKS.md,
    "Training step: the levers of the demo's time budget"), equal to rounding. That rounding once moved the demo's
    refer lead onto its plateau (docs/RESULTS.md, "Recipe levers"): a stalled lead starts the run again
    (FinetuneConfig.lead_retries)."""
    return torch.optim.AdamW(groups, lr=lr, fused=True)


def text_room(cfg: FinetuneConfig) -> int:
    """The fewest text tokens (max_length) the run's tasks can encode a word in: [CLS] and [SEP], the VQA head's answer
    slot where it reads one, and for multiple choice a [SEP] and a word of the choice (the longest choice is checked
    with the data: check_choices_fit)."""
    slot = cfg.vqa_pool if cfg.vqa_pool in ("answer_slot", "answer_segment") else False
    heads = {head_of(t, cfg.rank_pool) for t in training_tasks(cfg)}
    need = VLTokenizer.special_count(slot if "vqa" in heads else False) + 1
    return max(need, VLTokenizer.special_count() + 3) if "multiple_choice" in heads else need


def check_choices_fit(cfg: FinetuneConfig, data: TaskData, tokenizer: VLTokenizer) -> None:
    """TrainingError before the first step where the longest multiple-choice answer leaves its question no token."""
    choices = {c for split in (data.train, data.eval) for e in split.get("multiple_choice", []) for c in e.choices}
    if not choices:
        return
    longest = max(len(tokenizer.token_ids(c)) for c in choices)
    need = VLTokenizer.special_count() + 1 + longest + 1  # [CLS] question [SEP] choice [SEP]
    if cfg.max_length < need:
        raise TrainingError(f"max_length={cfg.max_length} leaves no room for the text: multiple choice needs at least "
                            f"{need} tokens (its longest choice is {longest} tokens)")


def check_lead(cfg: FinetuneConfig) -> None:
    """The run's tasks have finite weights above 0; the lead phase trains some of them, then the curriculum's phases
    train known tasks, all together for fewer steps than the run."""
    weights = list(cfg.tasks.values())
    if not weights:
        raise ValueError("tasks is empty: give at least one task:weight (e.g. vqa:1)")
    # NaN and inf pass a `> 0` test and give no sampling probabilities; neither may their sum
    if not all(math.isfinite(w) and w > 0 for w in weights) or not math.isfinite(sum(weights)):
        given = ", ".join(f"{t}:{w:g}" for t, w in cfg.tasks.items())
        raise ValueError(f"task weights must be finite numbers above 0, got {given}")
    if cfg.lead_steps < 0 or cfg.lead_steps >= max(1, cfg.steps):
        raise ValueError(f"lead_steps={cfg.lead_steps} must be 0 or more and fewer than steps={cfg.steps}")
    if cfg.lead_steps and not cfg.lead_tasks:
        raise ValueError("lead_steps needs lead_tasks: the tasks trained alone first")
    stray = [t for t in cfg.lead_tasks if cfg.tasks.get(t, 0) <= 0]
    if stray:
        raise ValueError(f"lead task(s) {', '.join(stray)} not among the run's tasks ({', '.join(cfg.tasks)})")
    if cfg.retrieval_queries and not {"itm", RANK_HEAD} & {head_of(t, cfg.rank_pool) for t in training_tasks(cfg)}:
        raise ValueError("retrieval_queries needs a task that trains the itm or rank head (itm, itm_rank or itm_rank_text)")
    if cfg.lead_retries < 0 or cfg.lead_takeoff < 0:
        raise ValueError(f"lead_retries={cfg.lead_retries} and lead_takeoff={cfg.lead_takeoff:g} must be 0 or more")
    if cfg.retrieval_pool is not None and not 2 <= cfg.retrieval_pool <= cfg.eval_scenes:
        raise ValueError(f"retrieval_pool={cfg.retrieval_pool} must be None or from 2 to eval_scenes={cfg.eval_scenes}")
    if cfg.query_bank < 0 or not (math.isfinite(cfg.query_bank_temperature) and cfg.query_bank_temperature > 0):
        raise ValueError(f"query_bank={cfg.query_bank} must be 0 or more and query_bank_temperature="
                         f"{cfg.query_bank_temperature:g} above 0 and finite")
    if cfg.rank_hard < 0 or cfg.rank_partial < 0 or cfg.rank_hard + cfg.rank_partial > RANK_GROUP - 1:
        raise ValueError(f"rank_hard={cfg.rank_hard} and rank_partial={cfg.rank_partial} must be 0 or more and together "
                         f"at most {RANK_GROUP - 1} (the negatives of a ranking group)")
    if cfg.query_bank and cfg.tasks.get(RANK_TASK, 0) <= 0:
        raise ValueError(f"query_bank draws the listing captions of the {RANK_TASK} set: give it a weight in tasks")
    if cfg.max_length < text_room(cfg):
        raise ValueError(f"max_length={cfg.max_length} leaves no room for the text: the run's tasks need at least "
                         f"{text_room(cfg)} tokens (with [CLS], [SEP] and their heads' special tokens)")
    if cfg.query_bank > cfg.train_scenes:  # one listing caption per training scene
        raise ValueError(f"query_bank={cfg.query_bank} needs as many distinct listing captions: train_scenes="
                         f"{cfg.train_scenes} have at most {cfg.train_scenes}")
    known = (*TASKS, *TRAINING_SETS)
    for steps, tasks in cfg.curriculum:
        if steps <= 0 or not tasks:
            raise ValueError(f"curriculum phase ({steps}, {tasks}) needs a positive step count and at least one task")
        unknown = [t for t in tasks if t not in known]
        if unknown:
            raise ValueError(f"curriculum task(s) {', '.join(unknown)} unknown (choose {', '.join(known)})")
    total = cfg.lead_steps + sum(steps for steps, _ in cfg.curriculum)
    if cfg.curriculum and total >= cfg.steps:
        raise ValueError(f"the lead phase and the curriculum take {total} steps, not fewer than steps={cfg.steps}")


def training_tasks(cfg: FinetuneConfig) -> list[str]:
    """The run's tasks, then the curriculum's tasks that are not among them."""
    return list(dict.fromkeys([*cfg.tasks, *(t for _, tasks in cfg.curriculum for t in tasks)]))


def phase_weights(cfg: FinetuneConfig) -> list[tuple[int, np.ndarray]]:
    """(first step after the phase, sampling weights over training_tasks) for the lead phase, each curriculum phase
    and the mix (which runs to the end); a phase's tasks keep their weight in `tasks`, or 1."""
    names = training_tasks(cfg)
    mix = np.array([cfg.tasks.get(t, 0.0) for t in names], dtype=np.float64)
    phases, end = [], 0
    for steps, tasks in ((cfg.lead_steps, cfg.lead_tasks), *cfg.curriculum):
        if steps:
            end += steps
            phases.append((end, np.array([cfg.tasks.get(t, 1.0) if t in tasks else 0.0 for t in names])))
    return phases + [(cfg.steps, mix)]


def lr_scale(step: int, cfg: FinetuneConfig) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    return max(0.0, (cfg.steps - step) / max(1, cfg.steps - cfg.warmup))


class TrainingError(ValueError):
    """A run that cannot go on, in one line: a train_state.pt it cannot resume, or a loss or weights no longer
    finite."""


def diverged(step: int, what: str, state: Path | None = None) -> TrainingError:
    """The error a run stops with once its loss or weights are not finite: nothing is written after that, and
    save_state never writes such weights, so a train_state.pt already there holds an earlier, finite step."""
    kept = f"; {state} holds an earlier step (delete it to start over)" if state is not None and state.exists() else ""
    return TrainingError(f"training diverged at step {step}: {what}; no checkpoint written (try a lower learning "
                         f"rate){kept}")


def finite_weights(model: torch.nn.Module) -> bool:
    """Whether every parameter is finite, in one device sync: a step with a finite loss may still leave inf or NaN
    weights."""
    return bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())


# Run-config fields that do not change what a run trains (where it runs and writes, what it reports and when it
# saves): every other field, and the detector's fingerprint, must be those of the run that wrote a train_state.pt
NOT_RUN_FIELDS = ("out", "force", "threads", "device", "detector_dir", "checkpoint_every", "eval_every",
                  "eval_examples", "final_eval_examples", "eval_scenes", "log_every", "retrieval_queries",
                  "retrieval_pool", "query_bank", "query_bank_temperature")


def detector_fingerprint(detector_dir: Path) -> str | None:
    """The fingerprint of the detector at detector_dir, read from its manifest (None where it cannot be read: loading
    the detector says why)."""
    from models.detector.io import fingerprint_of

    try:
        return fingerprint_of(json.loads((Path(detector_dir) / "manifest.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_key(cfg) -> dict:
    """What a run's train_state.pt records of it, and a run resuming it must share: every field that changes what it
    trains (all but NOT_RUN_FIELDS) and the detector's fingerprint, as plain data."""
    fields = {f.name: _jsonable(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name not in NOT_RUN_FIELDS}
    return {**fields, "detector": detector_fingerprint(cfg.detector_dir)}


def resume_key(cfg: FinetuneConfig) -> dict:
    """What a fine-tuning run's train_state.pt records of it (run_key: the tasks and their weights among them)."""
    return run_key(cfg)


def save_state(path: Path, model, opt, step: int, rng: np.random.Generator, losses: list, run: dict) -> None:
    """Write the resumable state of `run` (resume_key) at `step`; TrainingError (diverged) instead when the weights
    are not finite."""
    if not finite_weights(model):
        raise diverged(step, "the weights are not finite", path)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "run": run,
                "numpy_rng": rng.bit_generator.state, **rng_state(model_device(model)), "losses": losses}, tmp)
    tmp.replace(path)  # never a half-written state file


def _cannot_resume(path: Path, why: str) -> TrainingError:
    return TrainingError(f"{path} {why}: delete it to start the run over, or resume with the options it was started "
                         f"with")


def read_state(path: Path, run: dict, mmap: bool = False) -> dict:
    """The save_state file at path, if `run` (resume_key) can resume it; TrainingError when it cannot be read, is
    another run's or is past the run's steps. `mmap` leaves its tensors on disk (a check before the data work)."""
    try:
        # our own file, still never unpickled beyond plain data; tensors land on the CPU, load_state_dict moves them
        state = torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except OSError as exc:
        raise _cannot_resume(path, f"cannot be read ({exc.strerror})") from None
    except Exception:  # torch.load raises whatever its reader met in a torn or foreign file, with advice not for us
        raise _cannot_resume(path, "cannot be read: it is torn, or not a training state") from None
    if not isinstance(state, dict) or not {"model", "optimizer", "step", "numpy_rng", "losses"} <= state.keys():
        raise _cannot_resume(path, "is not a resumable training state")
    recorded = state.get("run")  # None in a state written before runs were recorded: its step and tensors are checked
    if recorded is not None:
        changed = [f"--{name.replace('_', '-')} " + (f"{recorded[name]!r}, not {value!r}" if name in recorded
                                                      else "not recorded (an older vlserve's state)")
                   for name, value in run.items() if recorded.get(name) != value]
        if changed:
            raise _cannot_resume(path, f"is from another run ({'; '.join(changed)})")
    if int(state["step"]) > run["steps"]:
        raise _cannot_resume(path, f"is at step {state['step']}, past steps={run['steps']}")
    return state


def load_state(path: Path, model, opt, rng: np.random.Generator, run: dict) -> tuple[int, list]:
    """Restore a save_state file of `run` (read_state) into model and opt (on whatever device the model is: the
    file may come from another)."""
    state = read_state(path, run)
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError):  # another model's tensors, in a state that records no run
        raise _cannot_resume(path, "does not fit the run's model or optimizer") from None
    rng.bit_generator.state = state["numpy_rng"]
    set_rng_state(state, model_device(model))
    return int(state["step"]), list(state["losses"])


def run_data(cfg: FinetuneConfig, progress: bool = True, *also: FinetuneConfig) -> TaskData:
    """The regions and examples a run trains and is scored on (extracted once per detector, then cached): the
    ranking groups and question sets only where the run (or one of `also`, runs on the same data) trains them."""
    tasks = {t for c in (cfg, *also) for t in training_tasks(c)}
    ranker = next((c for c in (cfg, *also) if set(training_tasks(c)) & set(RANK_TASKS)), cfg)  # whose groups they are
    return prepare_task_data(cfg.detector_dir, cfg.train_scenes, cfg.eval_scenes, cfg.easy_vqa, progress,
                             easy_vqa_images=cfg.easy_vqa_images, ranking=bool(tasks & set(RANK_TASKS)),
                             rank_groups={"hard": ranker.rank_hard, "partial": ranker.rank_partial},
                             question_sets=bool(tasks & {*QUESTION_SETS, *EXPRESSION_SETS}), device=cfg.device)


def pairs_per_example(task: str, pool: list) -> int:
    """Pairs one example of a training set scores: images per caption (itm_rank), captions per image
    (itm_rank_text), else 1; a step scores batch_size pairs."""
    if task not in RANK_TASKS:
        return 1
    return len(pool[0].rows) if task == RANK_TASK else 1 + len(pool[0].choices)


def collate_kind(model: VLModel, task: str, head: str) -> str:
    """How a training set's batches are laid out: the ranking sets as groups, the others as their head's kind."""
    return task if task in RANK_TASKS else model.config.heads[head].kind


def batch_loss(model: VLModel, task: str, head: str, inputs, labels: torch.Tensor, group: int) -> torch.Tensor:
    """A training batch's loss: listwise over each group for the ranking sets (plus the pairwise term on the ranking
    head, which learns nothing else, so that its scores read as probabilities too), else the head's own loss."""
    if task in RANK_TASKS:
        return group_ranking_loss(model(inputs, head).logits, group, labels, pointwise=head == RANK_HEAD)
    return model(inputs, head, labels).loss


LEAD_WINDOW = 25  # steps at each end of the lead phase whose mean losses decide whether it took off
RESTARTS = "lead_restarts.txt"  # beside the resumable state: how many times the run has started again


class LeadStalled(Exception):
    def __init__(self, data: TaskData, first: float, last: float) -> None:
        super().__init__(f"lead loss {first:.3f} -> {last:.3f}")
        self.data = data


def lead_stalled(cfg: FinetuneConfig, losses: list[float]) -> tuple[bool, float, float]:
    """(stalled, first, last): the lead phase's mean loss over its first and last LEAD_WINDOW steps."""
    window = min(LEAD_WINDOW, max(1, cfg.lead_steps // 2))
    first, last = float(np.mean(losses[:window])), float(np.mean(losses[cfg.lead_steps - window:cfg.lead_steps]))
    return last > cfg.lead_takeoff * first, first, last


def train(cfg: FinetuneConfig, data: TaskData | None = None, progress: bool = True, stop_after: int | None = None) -> dict:
    """Multi-task fine-tuning; resumes from out/train_state.pt when present. Returns the metrics. A stalled lead
    phase (lead_stalled) starts the run again with the next seed, up to cfg.lead_retries times."""
    check_lead(cfg)  # before any data is prepared
    resolve_device(cfg.device)
    out, run = Path(cfg.out), resume_key(cfg)  # the run as given: its seed, not the seed a restart reached
    if (out / STATE).exists():  # a state the run cannot resume fails it now, not after the data work
        read_state(out / STATE, run, mmap=True)
    else:  # a new run: nothing of an earlier one's restarts
        (out / RESTARTS).unlink(missing_ok=True)
    # a run resumed after an interruption goes on with the seed its restarts had reached
    restarts = int((out / RESTARTS).read_text()) if (out / RESTARTS).exists() else 0
    while True:
        try:
            result = _train(replace(cfg, seed=cfg.seed + restarts), data, progress, stop_after, restarts, run)
        except LeadStalled as stalled:
            restarts += 1
            data = stalled.data
            log.warning("%s: the lead phase stalled (%s); starting again with seed %d", cfg.out, stalled, cfg.seed + restarts)
            (out / STATE).unlink(missing_ok=True)
            (out / RESTARTS).write_text(str(restarts))
            continue
        if "final" in result:
            (out / RESTARTS).unlink(missing_ok=True)
        return result


def _train(cfg: FinetuneConfig, data: TaskData | None, progress: bool, stop_after: int | None, restarts: int,
           run: dict) -> dict:
    """One run of train() with cfg's seed; raises LeadStalled while restarts remain (cfg.lead_retries - restarts)."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    data = prepared = data or run_data(cfg, progress)
    unknown = set(training_tasks(cfg)) - set(data.train)
    if unknown:
        raise ValueError(f"no training data for task(s) {', '.join(sorted(unknown))}")
    captions = len({e.text for e in data.train.get(RANK_TASK, [])})
    if cfg.query_bank > captions:  # the bank is drawn after training: found out now, not then
        raise TrainingError(f"query_bank={cfg.query_bank} needs as many distinct listing captions of the training "
                            f"scenes, they have {captions}: lower --query-bank or raise --train-scenes")
    tokenizer = VLTokenizer.pretrained_minilm(max_length=cfg.max_length)
    check_choices_fit(cfg, data, tokenizer)
    model = build_model(cfg, data.feature_dim, len(data.answers))
    data = tagged(data, model, tokenizer)
    if cfg.init_from is None:  # a pretrained encoder brings its own statistics
        fit_feature_norm(model, data.train_table)
    if cfg.freeze_word_embeddings:  # before the optimizer: param_groups skips frozen parameters
        model.encoder.embeddings.word_embeddings.weight.requires_grad_(False)
    device = resolve_device(cfg.device)
    model.to(device)
    opt = adamw(param_groups(model, cfg), cfg.lr)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    step, losses = (load_state(out / STATE, model, opt, rng, run) if (out / STATE).exists() else (0, []))
    tasks, phases = training_tasks(cfg), phase_weights(cfg)
    history: list[dict] = []
    precision, bf16 = eval_precision(cfg.bf16, device), train_precision(cfg.bf16, device) == "bf16"
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc="finetune", disable=not progress)
    while step < cfg.steps:
        # set lr
        for group in opt.param_groups:
            group["lr"] = group["peak_lr"] * lr_scale(step, cfg)
        # eval / checkpoint
        if step and step % cfg.eval_every == 0:
            with gemm_precision(model, precision):
                history.append({"step": step, **evaluate_tasks(model, data, tokenizer, cfg.eval_examples)})
            log.info("step %d: %s", step, history[-1])
        if step and step % cfg.checkpoint_every == 0:
            save_state(out / STATE, model, opt, step, rng, losses, run)
        if step and step == cfg.lead_steps and cfg.lead_retries:
            stalled, first, last = lead_stalled(cfg, losses)
            if stalled and restarts < cfg.lead_retries:
                bar.close()
                raise LeadStalled(prepared, first, last)
            if stalled:
                log.warning("%s: the lead phase stalled again (loss %.3f -> %.3f) after %d restarts; going on",
                            cfg.out, first, last, restarts)
        # forward / backward
        model.train()
        w = next(weights for end, weights in phases if step < end)
        task = tasks[int(rng.choice(len(tasks), p=w / w.sum()))]
        pool = data.train[task]
        head, group = head_of(task, cfg.rank_pool), pairs_per_example(task, pool)
        batch = [pool[int(i)] for i in rng.integers(0, len(pool), max(1, cfg.batch_size // group))]
        inputs, labels = collate(collate_kind(model, task, head), batch, data.train_table, tokenizer,
                                 model.config.heads[head], cfg.max_length)
        inputs, labels = to_device((inputs, labels), device)
        with autocast(bf16, device):
            loss = batch_loss(model, task, head, inputs, labels, group)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        losses.append(round(loss.item(), 6))
        if not math.isfinite(losses[-1]):  # no sync of its own: the loss was read for the log above
            bar.close()
            raise diverged(step + 1, f"the {task} loss is {losses[-1]}", out / STATE)
        step += 1
        bar.update(1)
        bar.set_postfix(task=task, loss=f"{loss.item():.3f}")
        if stop_after is not None and step >= stop_after:  # simulated interruption (tests)
            save_state(out / STATE, model, opt, step, rng, losses, run)
            return {"losses": losses, "interrupted_at": step}
    bar.close()
    train_seconds = time.perf_counter() - start
    if not finite_weights(model):  # the last step's loss was finite, its update need not be
        raise diverged(step, "the weights are not finite", out / STATE)
    bank = training_bank(data.train[RANK_TASK], cfg.query_bank, cfg.query_bank_temperature, cfg.seed) if cfg.query_bank else None
    with gemm_precision(model, precision):
        final = evaluate_tasks(model, data, tokenizer, cfg.final_eval_examples)
        if cfg.retrieval_queries:
            found = evaluate_retrieval(model, data, tokenizer, cfg.retrieval_queries, directions=("text_to_image",),
                                       bank=bank, pool=cfg.retrieval_pool)
            final.update(card_metrics(found) if found else {})
    model.cpu()  # the checkpoint's tensors, whatever the device
    metrics = {"final": final, "history": history, "train_seconds": round(train_seconds, 1),
               "train_precision": "bf16" if bf16 else "fp32", "eval_precision": precision, "lead_restarts": restarts,
               "device": str(device) if device.type == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})",
               "config": _jsonable(asdict(cfg))}
    save_checkpoint(
        model, out, tokenizer,
        labels={"heads": {"vqa": data.answers} if "vqa" in cfg.tasks else {}, "objects": data.objects, "attributes": data.attributes,
                **({BANK_KEY: bank.to_labels()} if bank else {})},
        detector={"fingerprint": data.fingerprint, "feature_dim": data.feature_dim},
        extra={"training": metrics},
    )
    (out / STATE).unlink(missing_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return {**metrics, "losses": losses}


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value

