"""`vlserve train pretrain`: each preset's paper objectives over cached region features (extract once, train many).

Objectives (names of `PretrainConfig.objectives`):
  mlm       masked LM with the image (every seed system)
  mrfr      masked region feature regression (LXMERT)
  mrc       masked region classification against the detector's class (LXMERT, VL-BERT)
  mrc_kl    masked region classification as KL to the detector's class distribution (ViLBERT); the region
            cache keeps each region's top class only, so the distribution is its one-hot
  itm       image-text matching, half of the pairs mismatched (VisualBERT, ViLBERT, LXMERT)
  image_qa  answer the question when it is asked of its own image (LXMERT)
  tag       reconstruct masked detector tags (U-VisualBERT)
  weak      U-VisualBERT's weakly-supervised mode: text-only MLM batches and image-only batches
            (masked region classification + tag reconstruction, tags anchoring regions to words); never paired
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from models import HeadConfig, VLInputs, VLModel, create_model
from models.checkpoint import CheckpointError, save_checkpoint
from models.detector import DetectorConfig
from models.detector.io import load_detector
from models.registry import encoder_config
from models.text_init import init_text_from_minilm
from models.tokenizer import VLTokenizer

from .data.region_table import tags_of
from .evaluate import evaluate_tasks
from .device import autocast, model_device, resolve_device, to_device
from .finetune import (
    STATE, TrainingError, _jsonable, adamw, diverged, finite_weights, fit_feature_norm, load_state, lr_scale,
    param_groups, read_state, run_key, save_state, train_precision,
)
from .run_config import DEFAULT_OBJECTIVES, MLM_WORDS, PretrainConfig, embedding_override  # noqa: F401 (DEFAULT_OBJECTIVES: read from here)
from .objectives import (
    IGNORE, TokenIds, grounded_token_ids, image_only_batch, image_qa_labels, itm_pairs, mask_regions, mask_tokens, pretraining_losses,
    region_class_labels, text_only_batch, with_images,
)
from .vl_data import TaskData, prepare_task_data

log = logging.getLogger(__name__)

OBJECTIVES = ("mlm", "mrfr", "mrc", "mrc_kl", "itm", "image_qa", "tag", "weak")
ONLY_FOR = {"tag": "u-visualbert", "weak": "u-visualbert"}  # objectives that read detector tags as input
WEAK_HEADS = ("mlm", "mrc", "tag")  # text-only batches train mlm, image-only batches mrc and tag


class PretrainConfigError(ValueError):
    """A configuration, data set or train_state.pt pretraining cannot run with (raised before the first step), or a
    run that diverged: the command's one `error:` line."""


def validate_config(cfg: PretrainConfig) -> DetectorConfig:
    """Fail with one PretrainConfigError before any data work; returns the detector's config."""
    try:
        # raises for an unknown preset, size or box embedding (a depth below 1 is checked below: it does not)
        run_encoder_config(cfg)
        resolve_device(cfg.device)  # an unknown device, or a GPU torch cannot see
    except ValueError as exc:
        raise PretrainConfigError(str(exc)) from None
    if cfg.num_layers is not None and cfg.num_layers < 1:
        raise PretrainConfigError(f"num_layers must be at least 1, got {cfg.num_layers}")
    unknown = [o for o in cfg.objectives if o not in OBJECTIVES]
    if unknown:
        raise PretrainConfigError(f"unknown objective {unknown[0]!r}; choose from {', '.join(OBJECTIVES)}")
    for objective in cfg.objectives:
        if ONLY_FOR.get(objective, cfg.preset) != cfg.preset:
            raise PretrainConfigError(f"objective {objective!r} is not supported by preset {cfg.preset!r} (only {ONLY_FOR[objective]})")
    if "weak" in cfg.objectives and len(cfg.objectives) > 1:
        raise PretrainConfigError("objective 'weak' trains on unpaired text and images only; it cannot be combined with "
                                  + ", ".join(o for o in cfg.objectives if o != "weak"))
    if {"mrc", "mrc_kl"} <= set(cfg.objectives):
        raise PretrainConfigError("choose one of mrc (cross-entropy) and mrc_kl (KL), not both")
    for name in ("mask_prob", "region_mask_prob", "mismatch_prob", "image_qa_batches"):
        if not 0.0 < getattr(cfg, name) <= 1.0:
            raise PretrainConfigError(f"{name} must be in (0, 1], not {getattr(cfg, name)}")
    if cfg.mlm_words not in MLM_WORDS:
        raise PretrainConfigError(f"unknown mlm_words {cfg.mlm_words!r}; choose from {', '.join(MLM_WORDS)}")
    if cfg.mlm_words == "grounded" and ("mlm" not in cfg.objectives or "weak" in cfg.objectives):
        raise PretrainConfigError("mlm_words 'grounded' needs the mlm objective on paired text and images (not 'weak')")
    if cfg.mlm_matched_only and not {"mlm", "itm"} <= set(cfg.objectives):
        raise PretrainConfigError("mlm_matched_only needs both the mlm and the itm objective")
    if "itm" in cfg.objectives and cfg.batch_size < 2:
        raise PretrainConfigError("itm needs batch_size >= 2 (a mismatched pair borrows another row's image)")
    if cfg.init_text and cfg.size != "small":
        raise PretrainConfigError("--init-text needs size small (MiniLM has hidden size 384)")
    if cfg.max_length < VLTokenizer.special_count() + 1:
        raise PretrainConfigError(f"max_length={cfg.max_length} leaves no room for the text: at least "
                                  f"{VLTokenizer.special_count() + 1} tokens ([CLS], a word, [SEP])")
    try:
        detector, _ = load_detector(cfg.detector_dir)
    except CheckpointError as exc:
        raise PretrainConfigError(f"detector: {exc}") from None
    dim = detector.config.feature_dim
    if cfg.visual_feat_dim is not None and cfg.visual_feat_dim != dim:
        raise PretrainConfigError(f"feature dim mismatch: visual_feat_dim={cfg.visual_feat_dim} but the detector "
                                  f"{cfg.detector_dir} produces {dim}-d region features")
    return detector.config


def check_data(cfg: PretrainConfig, data: TaskData, detector: DetectorConfig) -> None:
    """The prepared data comes from the detector and has what the objectives read."""
    dim = data.train_table.features.shape[-1]
    if dim != detector.feature_dim:
        raise PretrainConfigError(f"feature dim mismatch: the region features are {dim}-d but the detector "
                                  f"{cfg.detector_dir} produces {detector.feature_dim}-d")
    if list(data.objects) != list(detector.classes):
        raise PretrainConfigError(f"class mismatch: the data's object classes {data.objects} are not the detector's {detector.classes}")
    if not captions(data):
        raise PretrainConfigError("missing data: no captions (itm examples labelled 1) to pretrain on")
    if "image_qa" in cfg.objectives and not data.train.get("vqa"):
        raise PretrainConfigError("missing data: image_qa needs questions (vqa examples)")


def captions(data: TaskData) -> list:
    return [e for e in data.train.get("itm", []) if e.label == 1]



def resume_key(cfg: PretrainConfig) -> dict:
    """What a pretraining run's train_state.pt records of it, and a run resuming it must share (finetune.run_key:
    every option that changes what it trains, the objectives among them, and the detector's fingerprint)."""
    return run_key(cfg)


def pretraining_heads(objectives: tuple[str, ...], num_classes: int, num_answers: int) -> dict[str, HeadConfig]:
    """One head per objective, named by its kind (mrc_kl is the mrc head with the KL loss)."""
    tasks = WEAK_HEADS if "weak" in objectives else objectives
    heads = {}
    for objective in tasks:
        kind = "mrc" if objective == "mrc_kl" else objective
        num_labels = {"mrc": num_classes, "image_qa": num_answers}.get(kind, 0)
        heads[kind] = HeadConfig(kind=kind, num_labels=num_labels, mrc_loss="kl" if objective == "mrc_kl" else "ce")
    return heads


def run_encoder_config(cfg: PretrainConfig):
    """The EncoderConfig a run's preset, size, box embedding, embedding style and depth give (ValueError if none)."""
    return encoder_config(cfg.preset, cfg.size, box_embedding=cfg.box_embedding, **embedding_override(cfg), **layer_override(cfg))


def layer_override(cfg: PretrainConfig) -> dict:
    """The encoder-config field a depth other than the size's sets."""
    return {} if cfg.num_layers is None else {"num_layers": cfg.num_layers}


def build_model(cfg: PretrainConfig, feature_dim: int, num_classes: int, num_answers: int) -> VLModel:
    heads = pretraining_heads(cfg.objectives, num_classes, num_answers)
    model = create_model(cfg.preset, cfg.size, heads=heads, visual_feat_dim=feature_dim, feature_norm=cfg.feature_norm,
                         box_embedding=cfg.box_embedding, **embedding_override(cfg), **layer_override(cfg))
    if cfg.init_text:
        init_text_from_minilm(model)
    return model


@dataclass
class Batch:
    kind: str  # "paired"; weak mode: "text" (no image) or "image" (no text)
    inputs: VLInputs
    targets: dict[str, object]  # head name -> labels, as pretraining_losses reads them


class BatchBuilder:
    """Pretraining batches drawn from `rng`: a batch is a function of (rng state, step), so a resumed run sees the same."""

    def __init__(self, cfg: PretrainConfig, data: TaskData, tokenizer: VLTokenizer):
        self.cfg, self.table, self.tokenizer = cfg, data.train_table, tokenizer
        self.ids = TokenIds.from_tokenizer(tokenizer)
        self.captions = captions(data)
        self.questions = data.train.get("vqa", []) if "image_qa" in cfg.objectives else []
        self.num_answers, self.num_classes = len(data.answers), len(data.objects)
        # u-visualbert's regions carry their detector class words: (C,) one word each, or (C, K) every sub-word of
        # the name for the published embeddings
        style = run_encoder_config(cfg).embedding_style if cfg.preset == "u-visualbert" else None
        self.tag_words = tokenizer.tag_table(data.objects, style) if style else None
        self.heads = set(pretraining_heads(cfg.objectives, self.num_classes, self.num_answers))
        # masked LM targets restricted to the words the detector names (None: every word)
        self.grounded = grounded_token_ids(tokenizer, data.objects + data.attributes) if cfg.mlm_words == "grounded" else None

    def __call__(self, step: int, rng: np.random.Generator) -> Batch:
        g = torch.Generator().manual_seed(int(rng.integers(2**62)))  # every mask and pairing of this batch
        if "weak" in self.cfg.objectives:  # alternate, so text and images never meet in one batch
            return self.text_only(rng, g) if step % 2 == 0 else self.image_only(rng, g)
        return self.paired(rng, g)

    def text(self, examples: list) -> dict[str, torch.Tensor]:
        enc = self.tokenizer.encode([e.text for e in examples], max_length=self.cfg.max_length)
        return {k: torch.from_numpy(v) for k, v in enc.items()}

    def regions(self, rows: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Region inputs of table rows (with detector tags for u-visualbert) and their detector class ids (B, N)."""
        regions = self.table.tensors(rows)
        if self.tag_words is not None:
            regions["tag_ids"] = tags_of(self.table.obj_ids[rows], self.tag_words)
        return regions, torch.from_numpy(self.table.obj_ids[rows])

    def mask_image(self, inputs: VLInputs, classes: torch.Tensor, g: torch.Generator, targets: dict) -> VLInputs:
        """Masked region modelling: chosen regions lose their feature and their tag; targets of mrfr, mrc, tag."""
        if not self.heads & {"mrfr", "mrc", "tag"}:
            return inputs
        features, mrfr, chosen = mask_regions(inputs.region_features, inputs.region_mask, g, self.cfg.region_mask_prob)
        # a whole-image feature would still see the masked regions: the encoder recomputes it from the masked ones
        inputs = inputs.replace(region_features=features, image_feature=None)
        if "mrfr" in self.heads:
            targets["mrfr"] = mrfr
        if "mrc" in self.heads:
            kl = "mrc_kl" in self.cfg.objectives
            targets["mrc"] = region_class_labels(classes, chosen, "kl" if kl else "ce", self.num_classes)
        if inputs.tag_ids is not None:  # a masked region keeps no tag, or mrc would read its class off the tag
            tags = inputs.tag_ids
            # every sub-word of a chosen region's tag (tag_ids (B, N, K)); empty slots (-1) stay empty
            hidden = (chosen.unsqueeze(-1) if tags.dim() > chosen.dim() else chosen) & (tags >= 0)
            if "tag" in self.heads:
                targets["tag"] = tags.masked_fill(~hidden, IGNORE)
            inputs = inputs.replace(tag_ids=tags.masked_fill(hidden, self.ids.mask_id))
        return inputs

    def paired(self, rng: np.random.Generator, g: torch.Generator) -> Batch:
        cfg, targets = self.cfg, {}
        questions = bool(self.questions) and rng.random() < cfg.image_qa_batches
        pool = self.questions if questions else self.captions
        examples = [pool[int(i)] for i in rng.integers(0, len(pool), cfg.batch_size)]
        regions, classes = self.regions(np.array([e.rows[0] for e in examples]))
        inputs = VLInputs(**self.text(examples), **regions)
        matched = torch.ones(len(examples), dtype=torch.long)
        if "itm" in cfg.objectives:
            image_index, matched = itm_pairs(len(examples), g, cfg.mismatch_prob)
            inputs, classes = with_images(inputs, image_index), classes[image_index]
            targets["itm"] = matched
        if questions:
            answers = torch.nn.functional.one_hot(torch.tensor([e.label for e in examples]), self.num_answers).float()
            targets["image_qa"] = image_qa_labels(answers, matched)
        if "mlm" in cfg.objectives:
            input_ids, labels = mask_tokens(inputs.input_ids, inputs.attention_mask, self.ids, g, cfg.mask_prob, self.grounded)
            if cfg.mlm_matched_only:  # a word of a mismatched pair is not decided by its image
                labels = labels.masked_fill(~matched.bool().unsqueeze(-1), IGNORE)
            inputs, targets["mlm"] = inputs.replace(input_ids=input_ids), labels
        return Batch("paired", self.mask_image(inputs, classes, g, targets), targets)

    def text_only(self, rng: np.random.Generator, g: torch.Generator) -> Batch:
        examples = [self.captions[int(i)] for i in rng.integers(0, len(self.captions), self.cfg.batch_size)]
        text = self.text(examples)
        input_ids, labels = mask_tokens(text["input_ids"], text["attention_mask"], self.ids, g, self.cfg.mask_prob)
        inputs = text_only_batch(input_ids, text["attention_mask"], visual_feat_dim=self.table.features.shape[-1])
        return Batch("text", inputs, {"mlm": labels})

    def image_only(self, rng: np.random.Generator, g: torch.Generator) -> Batch:
        regions, classes = self.regions(rng.integers(0, len(self.table), self.cfg.batch_size))
        inputs = image_only_batch(**regions, tokenizer_ids=self.ids)
        targets: dict[str, object] = {}
        return Batch("image", self.mask_image(inputs, classes, g, targets), targets)


def pretrain(cfg: PretrainConfig, data: TaskData | None = None, progress: bool = True, stop_after: int | None = None) -> dict:
    """Pretrain; resumes from out/train_state.pt when present. Returns the metrics and the per-step losses."""
    try:
        return _pretrain(cfg, data, progress, stop_after)
    except TrainingError as exc:  # a train_state.pt the run cannot resume, or a diverged run
        raise PretrainConfigError(str(exc)) from None


def _pretrain(cfg: PretrainConfig, data: TaskData | None, progress: bool, stop_after: int | None) -> dict:
    detector = validate_config(cfg)
    out, run = Path(cfg.out), resume_key(cfg)
    if (out / STATE).exists():  # a state the run cannot resume fails it now, not after the data work
        read_state(out / STATE, run, mmap=True)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    data = data or prepare_task_data(cfg.detector_dir, cfg.train_scenes, cfg.eval_scenes, cfg.easy_vqa, progress,
                                     easy_vqa_images=cfg.easy_vqa_images, device=cfg.device)
    check_data(cfg, data, detector)
    tokenizer = VLTokenizer.pretrained_minilm(max_length=cfg.max_length)
    model = build_model(cfg, detector.feature_dim, len(data.objects), len(data.answers))
    fit_feature_norm(model, data.train_table)
    model.to(device)
    batches = BatchBuilder(cfg, data, tokenizer)
    opt = adamw(param_groups(model, cfg), cfg.lr)
    out.mkdir(parents=True, exist_ok=True)
    # records: one {objective: loss, "total": loss} per step; resumed with the state
    step, records = (load_state(out / STATE, model, opt, rng, run) if (out / STATE).exists() else (0, []))
    precision = train_precision(cfg.bf16, device)
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc=f"pretrain {cfg.preset}", disable=not progress)
    while step < cfg.steps:
        # set lr
        for group in opt.param_groups:
            group["lr"] = group["peak_lr"] * lr_scale(step, cfg)
        # checkpoint / log
        if step and step % cfg.checkpoint_every == 0:
            save_state(out / STATE, model, opt, step, rng, records, run)
        if step and step % cfg.log_every == 0:
            log.info("step %d: %s", step, window_means(records[-cfg.log_every :]))
        # forward / backward
        model.train()
        batch = batches(step, rng)
        inputs, targets = to_device((batch.inputs, batch.targets), device)
        with autocast(precision == "bf16", device):
            losses = pretraining_losses(model, inputs, targets)
        opt.zero_grad(set_to_none=True)
        losses["total"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        records.append({name: round(loss.item(), 6) for name, loss in losses.items()})
        if not math.isfinite(records[-1]["total"]):  # no sync of its own: the losses were read for the log above
            bar.close()
            raise diverged(step + 1, f"the loss is {records[-1]['total']} ({batch.kind} batch)", out / STATE)
        step += 1
        bar.update(1)
        bar.set_postfix(batch=batch.kind, loss=f"{records[-1]['total']:.3f}")
        if stop_after is not None and step >= stop_after:  # simulated interruption (tests)
            save_state(out / STATE, model, opt, step, rng, records, run)
            return {"losses": [r["total"] for r in records], "records": records, "interrupted_at": step}
    bar.close()
    train_seconds = time.perf_counter() - start
    if not finite_weights(model):  # the last step's loss was finite, its update need not be
        raise diverged(step, "the weights are not finite", out / STATE)
    history = [{"step": min(s + cfg.log_every, len(records)), **window_means(records[s : s + cfg.log_every])}
               for s in range(0, len(records), cfg.log_every)]
    final = evaluate_tasks(model, data, tokenizer, cfg.eval_examples)  # zero-shot ITM accuracy when there is an itm head
    if "weak" not in cfg.objectives:  # weak mode never sees a caption with its image
        final.update(grounded_word_accuracy(model, data, tokenizer, cfg.eval_examples))
    model.cpu()  # the checkpoint's tensors, whatever the device
    metrics = {"final": final, "history": history, "train_seconds": round(train_seconds, 1), "train_precision": precision,
               "config": _jsonable(asdict(cfg))}
    head_labels = {"mrc": data.objects, "image_qa": data.answers}
    save_checkpoint(
        model, out, tokenizer,
        labels={"heads": {t: names for t, names in head_labels.items() if t in model.heads},
                "objects": data.objects, "attributes": data.attributes},
        detector={"fingerprint": data.fingerprint, "feature_dim": data.feature_dim},
        extra={"training": metrics},
    )
    (out / STATE).unlink(missing_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return {**metrics, "losses": [r["total"] for r in records], "records": records}


@torch.inference_mode()
def grounded_word_accuracy(model: VLModel, data: TaskData, tokenizer: VLTokenizer, limit: int | None = None,
                           batch_size: int = 64) -> dict[str, float]:
    """Masked LM on the words only the image decides: in each held-out caption every sub-word of a detector class or
    attribute name is masked at once and predicted with the caption's own image (`mlm_grounded_acc`) and with the
    image of another scene (`mlm_grounded_acc_other_image`: what the text alone gives, plus chance agreement). The gap
    between the two is what masked LM reads off the image. {} for a model without an mlm head."""
    if "mlm" not in model.heads:
        return {}
    examples = [e for e in data.eval.get("itm", []) if e.label == 1][:limit]
    rows = np.array([e.rows[0] for e in examples], dtype=np.int64)
    other = other_scenes(rows)
    if other is None:
        return {}
    grounded = grounded_token_ids(tokenizer, data.objects + data.attributes)
    correct, total = {"own": 0, "other": 0}, 0
    model.eval()
    device = model_device(model)
    for s in range(0, len(examples), batch_size):
        batch = examples[s : s + batch_size]
        text = {k: torch.from_numpy(v) for k, v in tokenizer.encode([e.text for e in batch]).items()}
        ids = text["input_ids"]
        target = torch.isin(ids, grounded) & text["attention_mask"].bool()
        text["input_ids"] = ids.masked_fill(target, tokenizer.mask_id)
        for image, image_rows in (("own", rows[s : s + batch_size]), ("other", other[s : s + batch_size])):
            enc = model.forward_features(VLInputs(**text, **data.eval_table.tensors(image_rows)).to(device))
            guess = model.heads["mlm"].decode(enc.text[target.to(device)]).argmax(-1).cpu()
            correct[image] += int((guess == ids[target]).sum())
        total += int(target.sum())
    if not total:
        return {}
    return {"mlm_grounded_acc": round(correct["own"] / total, 4),
            "mlm_grounded_acc_other_image": round(correct["other"] / total, 4)}


def other_scenes(rows: np.ndarray) -> np.ndarray | None:
    """For each caption's image row, the row of another caption half the list away that shows another image (a scene's
    captions are consecutive, so a neighbour's image is usually its own); None when all show one image."""
    if len(np.unique(rows)) < 2:
        return None
    other = np.roll(rows, len(rows) // 2)
    for i in np.flatnonzero(other == rows):
        other[i] = rows[rows != rows[i]][i % int((rows != rows[i]).sum())]
    return other


def window_means(records: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each loss over the steps that had it (weak mode alternates text and image objectives)."""
    names = sorted({name for r in records for name in r})
    return {n: round(float(np.mean([r[n] for r in records if n in r])), 4) for n in names}
