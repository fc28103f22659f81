"""`vlserve train ...`: the detector, pretraining and fine-tuning runs (their options are the run configs' fields)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from training.run_config import (FinetuneConfig, PretrainConfig, RunConfig, config_command, embedding_override,
                                 field_choices, finite_within)
from vlserve.commands.checks import check_cache_root, check_out, fail, writing
from vlserve.commands.termination import unwinding

# the detector's sane bounds: region features up to 8x the 1024/2048-d of the published bottom-up-attention models,
# boxes up to 10x their 100 (beyond, the first allocation fails with a traceback, not a usage error)
MAX_FEATURE_DIM = 16_384
MAX_BOXES = 1_000

app = typer.Typer(help="Train the detector and the encoders.", no_args_is_help=True)


@app.command("detector")
@config_command(RunConfig, only=("seed", "threads", "force"), build=False)
def detector(
    out: Annotated[Path, typer.Option(help="checkpoint directory to write")],
    steps: Annotated[int, typer.Option(min=1, help="optimizer steps")] = 1200,
    batch_size: Annotated[int, typer.Option(min=1, help="images per step")] = 8,
    lr: Annotated[float, typer.Option(callback=finite_within(0.0), help="peak SGD learning rate (>= 0)")] = 0.01,
    eval_every: Annotated[int, typer.Option(min=1, help="steps between val mAP evaluations")] = 400,
    train_scenes: Annotated[int, typer.Option(min=1, help="shapes-world training scenes")] = 20_000,
    val_scenes: Annotated[int, typer.Option(min=1, help="shapes-world validation scenes")] = 2_000,
    test_scenes: Annotated[int, typer.Option(min=1, help="shapes-world test scenes")] = 2_000,
    feature_dim: Annotated[int, typer.Option(min=8, max=MAX_FEATURE_DIM, help="region feature dimension D")] = 512,
    num_boxes: Annotated[int, typer.Option(min=1, max=MAX_BOXES, help="regions per image (fixed mode)")] = 36,
    attribute_weight: Annotated[float, typer.Option(callback=finite_within(0.0), help="weight of the colour/size "
                                                    "attribute loss beside the box and class losses (>= 0)")] = 1.0,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N: where the model trains")] = "cpu",
    *,
    seed: int,  # RunConfig's options
    threads: int,
    force: bool,
) -> None:
    """Fine-tune the EfficientNet-Lite0 Faster R-CNN region detector on shapes-world scenes."""
    from training.data.shapes_cache import ShapesConfig
    from training.detector_train import DetectorTrainConfig, train_detector
    from training.device import resolve_device
    from training.finetune import TrainingError

    try:
        resolve_device(device)
    except ValueError as exc:
        fail(str(exc))
    check_out(out, force=force)
    check_cache_root()
    data = ShapesConfig(splits=(("train", train_scenes), ("val", val_scenes), ("test", test_scenes)))
    cfg = DetectorTrainConfig(out=out, steps=steps, batch_size=batch_size, lr=lr, eval_every=eval_every, seed=seed, threads=threads,
                              device=device, attribute_weight=attribute_weight, data=data, detector={"feature_dim": feature_dim, "num_boxes": num_boxes})
    with writing(out):
        try:
            metrics = unwinding(train_detector, cfg)
        except TrainingError as exc:  # diverged: nothing written
            fail(str(exc))
    typer.echo(json.dumps({"out": str(out), "val": metrics["val"], "train_seconds": metrics["train_seconds"],
                           "fingerprint": metrics["fingerprint"]}, indent=2))


@app.command("finetune")
@config_command(FinetuneConfig, required=("out", "detector_dir"))
def finetune(cfg: FinetuneConfig) -> None:
    """Multi-task fine-tuning: one shared encoder with vqa, refer, itm, nlvr2 and multiple_choice heads."""
    from training.finetune import TrainingError, train

    try:
        validate_finetune(cfg)
    except ValueError as exc:
        fail(str(exc))
    check_out(cfg.out, reads={"--detector": cfg.detector_dir, "--init-from": cfg.init_from}, resumes=True, force=cfg.force)
    check_cache_root()
    with writing(cfg.out):
        try:
            metrics = unwinding(train, cfg)
        except TrainingError as exc:  # diverged, or a train_state.pt of another run: nothing written
            fail(str(exc))
    typer.echo(json.dumps({"out": str(cfg.out), "final": metrics["final"], "train_seconds": metrics["train_seconds"]}, indent=2))


@app.command("pretrain")
@config_command(PretrainConfig, required=("out", "detector_dir"))
def pretrain(cfg: PretrainConfig) -> None:
    """Pretrain an encoder preset with its paper's objectives (weak mode for u-visualbert) on cached regions."""
    from training.pretrain import PretrainConfigError
    from training.pretrain import pretrain as run_pretrain

    check_out(cfg.out, reads={"--detector": cfg.detector_dir}, resumes=True, force=cfg.force)
    check_cache_root()
    with writing(cfg.out):
        try:
            metrics = unwinding(run_pretrain, cfg)  # validates the config, then the data, before the first step
        except PretrainConfigError as exc:
            fail(str(exc))
    typer.echo(json.dumps({"out": str(cfg.out), "objectives": list(cfg.objectives), "final": metrics["final"],
                           "last": metrics["history"][-1], "train_seconds": metrics["train_seconds"]}, indent=2))


def validate_finetune(cfg) -> None:
    """Fail before any data is prepared: unknown preset/size/task, missing detector, an --init-from checkpoint of
    another preset, size, feature dim or detector."""
    from models.checkpoint import CheckpointError, load_checkpoint
    from models.detector.io import load_detector
    from models.registry import encoder_config
    from training.finetune import RANK_TASKS, TASKS, TRAINING_SETS, check_lead, training_tasks
    from training.device import resolve_device

    resolve_device(cfg.device)  # an unknown device, or a GPU torch cannot see

    layers = {} if cfg.num_layers is None else {"num_layers": cfg.num_layers}
    encoder = encoder_config(cfg.preset, cfg.size, box_embedding=cfg.box_embedding, region_tags=cfg.region_tags,
                             **embedding_override(cfg), **layers)  # unknown preset, size, ...
    for name in ("vqa_loss", "vqa_pool", "itm_pool", "nlvr2_pool", "rank_pool"):
        allowed, value = field_choices(FinetuneConfig, name), getattr(cfg, name)
        if value is not None and value not in allowed:
            raise ValueError(f"--{name.replace('_', '-')} must be {', '.join(allowed[:-1])} or {allowed[-1]}, not {value!r}")
    if cfg.rank_pool and not set(training_tasks(cfg)) & set(RANK_TASKS):
        raise ValueError("--rank-pool names the ranking head's pool: add itm_rank or itm_rank_text to --tasks")
    unknown = set(cfg.tasks) - {*TASKS, *TRAINING_SETS}
    if unknown:
        raise ValueError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, sorted(unknown)))} in "
                         f"--tasks; choose from {', '.join((*TASKS, *TRAINING_SETS))}")
    if cfg.dropout is not None and not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1), not {cfg.dropout}")
    if any(w <= 0 for w in cfg.tasks.values()):
        raise ValueError("task weights must be positive")
    check_lead(cfg)
    if cfg.init_text and cfg.init_from is None and cfg.size != "small":
        raise ValueError("--init-text needs size small (MiniLM has hidden size 384)")
    try:
        detector, fingerprint = load_detector(cfg.detector_dir)
    except CheckpointError as exc:
        raise ValueError(f"detector: {exc}") from None
    if cfg.init_from is not None:
        try:
            source = load_checkpoint(cfg.init_from, preset=cfg.preset, size=cfg.size, visual_feat_dim=detector.config.feature_dim)
        except CheckpointError as exc:
            raise ValueError(f"--init-from: {exc}") from None
        theirs = (source.manifest.get("detector") or {}).get("fingerprint")  # none recorded: an imported checkpoint
        if theirs is not None and theirs != fingerprint:
            raise ValueError(f"--init-from: {cfg.init_from} was trained on the regions of detector {theirs}, --detector "
                             f"{cfg.detector_dir} is detector {fingerprint}; start from a checkpoint of this detector, "
                             f"or pass the detector it was trained with")
        for name, want in (("box_embedding", cfg.box_embedding), ("embedding_style", encoder.embedding_style)):
            theirs = getattr(source.model.config.encoder, name)
            if theirs != want:
                raise ValueError(f"--init-from: encoder.{name} is {theirs!r}, expected {want!r} "
                                 f"(pass --{name.replace('_', '-')} {theirs})")
        if source.model.config.encoder.num_layers != encoder.num_layers:
            raise ValueError(f"--init-from: the encoder has {source.model.config.encoder.num_layers} layers, the run "
                             f"{encoder.num_layers} (pass --num-layers {source.model.config.encoder.num_layers})")
