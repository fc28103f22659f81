"""`vlserve train ...`: training commands (the detector now; pretraining and fine-tuning with issue 4)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

BOX_EMBEDDING_HELP = ("u-visualbert: linear (Linear(4, H) summed with the features) or normalized (layer-normalised sin/cos "
                      "box geometry beside the layer-normalised features, as LXMERT)")
app = typer.Typer(help="Train the detector and the encoders.", no_args_is_help=True)


@app.command("detector")
def detector(
    out: Annotated[Path, typer.Option(help="checkpoint directory to write")],
    steps: Annotated[int, typer.Option(min=1, help="optimizer steps")] = 1200,
    batch_size: Annotated[int, typer.Option(min=1, help="images per step")] = 8,
    lr: Annotated[float, typer.Option(min=0.0, help="peak SGD learning rate")] = 0.01,
    eval_every: Annotated[int, typer.Option(min=1, help="steps between val mAP evaluations")] = 400,
    train_scenes: Annotated[int, typer.Option(min=1, help="shapes-world training scenes")] = 20_000,
    val_scenes: Annotated[int, typer.Option(min=1, help="shapes-world validation scenes")] = 2_000,
    test_scenes: Annotated[int, typer.Option(min=1, help="shapes-world test scenes")] = 2_000,
    feature_dim: Annotated[int, typer.Option(min=8, help="region feature dimension D")] = 512,
    num_boxes: Annotated[int, typer.Option(min=1, help="regions per image (fixed mode)")] = 36,
    seed: Annotated[int, typer.Option(help="seed of data order and initialisation")] = 0,
    threads: Annotated[int, typer.Option(min=1, help="torch threads")] = 2,
    attribute_weight: Annotated[float, typer.Option(min=0.0, help="weight of the colour/size attribute loss beside "
                                                                   "the box and class losses")] = 1.0,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N: where the model trains")] = "cpu",
) -> None:
    """Fine-tune the EfficientNet-Lite0 Faster R-CNN region detector on shapes-world scenes."""
    from training.data.shapes_cache import ShapesConfig
    from training.detector_train import DetectorTrainConfig, train_detector
    from training.device import resolve_device

    try:
        resolve_device(device)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    data = ShapesConfig(splits=(("train", train_scenes), ("val", val_scenes), ("test", test_scenes)))
    cfg = DetectorTrainConfig(out=out, steps=steps, batch_size=batch_size, lr=lr, eval_every=eval_every, seed=seed, threads=threads,
                              device=device, attribute_weight=attribute_weight, data=data, detector={"feature_dim": feature_dim, "num_boxes": num_boxes})
    metrics = train_detector(cfg)
    typer.echo(json.dumps({"out": str(out), "val": metrics["val"], "train_seconds": metrics["train_seconds"],
                           "fingerprint": metrics["fingerprint"]}, indent=2))


@app.command("finetune")
def finetune(
    out: Annotated[Path, typer.Option(help="encoder checkpoint directory to write (resumed if it holds train_state.pt)")],
    detector: Annotated[Path, typer.Option(help="detector checkpoint directory (regions are extracted once and cached)")],
    preset: Annotated[str, typer.Option(help="visualbert, vl-bert, vilbert, lxmert or u-visualbert")] = "visualbert",
    size: Annotated[str, typer.Option(help="tiny, small or base")] = "small",
    num_layers: Annotated[int | None, typer.Option(min=1, help="encoder (text) layers (default: the size's; small: "
                                                               "MiniLM's 6, fewer start from its first layers)")] = None,
    tasks: Annotated[str, typer.Option(help="comma-separated task:weight list over vqa, refer, itm, nlvr2, multiple_choice and "
                                           "itm_rank / itm_rank_text (retrieval groups, a listwise ranking loss through the itm head: a "
                                           "caption with 8 images / an image with its listing and 7 near-miss listings), and the question sets trained through the "
                                           "vqa head: positions / positions_one_side (one-object positions), relations and attributes (every "
                                           "relation or attribute question of a training scene), related_attributes (attribute questions about objects "
                                           "named through a relation that decides); related_refer (such expressions, through the refer head)")] = "vqa:1,refer:1,itm:1,nlvr2:1",
    lead_tasks: Annotated[str, typer.Option(help="comma-separated tasks trained alone for the first --lead-steps steps "
                                                 "(a grounding curriculum, e.g. refer)")] = "",
    lead_steps: Annotated[int, typer.Option(min=0, help="steps of the lead phase (0: every task from the start)")] = 0,
    lead_retries: Annotated[int, typer.Option(min=0, help="a lead phase whose loss has not fallen below 0.8x its start "
                                                          "starts the run again with the next seed, this many times")] = 0,
    curriculum: Annotated[str, typer.Option(help="phases after the lead phase, in order, as TASKS=STEPS items (TASKS "
                                                 "joined by +), e.g. positions_one_side=200,positions=200: one-object "
                                                 "position questions through the vqa head")] = "",
    steps: Annotated[int, typer.Option(min=1)] = 2000,
    batch_size: Annotated[int, typer.Option(min=1)] = 32,
    lr: Annotated[float, typer.Option(min=0.0, help="encoder peak learning rate")] = 1e-4,
    head_lr: Annotated[float, typer.Option(min=0.0, help="heads' peak learning rate")] = 1e-3,
    train_scenes: Annotated[int, typer.Option(min=1)] = 20_000,
    eval_scenes: Annotated[int, typer.Option(min=1)] = 1_000,
    easy_vqa: Annotated[bool, typer.Option(help="add easy-VQA training questions to vqa")] = True,
    init_text: Annotated[bool, typer.Option(help="start the text side from MiniLM (size small)")] = True,
    init_from: Annotated[Path | None, typer.Option(help="start the encoder (and same-named heads) from this checkpoint, "
                                                        "e.g. a pretraining run")] = None,
    eval_every: Annotated[int, typer.Option(min=1)] = 500,
    retrieval_queries: Annotated[int, typer.Option(min=0, help="final text -> image R@1/5/10 of this many listing "
                                                               "captions over all eval scenes (0: none)")] = 0,
    retrieval_pool: Annotated[int | None, typer.Option(help="rank over the first this many eval scenes instead of all: "
                                                            "with a query bank each is also scored with every bank "
                                                            "caption")] = None,
    query_bank: Annotated[int, typer.Option(min=0, help="keep this many listing captions of the itm_rank groups as the "
                                                        "checkpoint's query bank: /retrieve and R@K then rank each image's "
                                                        "score against its scores with them (0: raw scores)")] = 0,
    query_bank_temperature: Annotated[float, typer.Option(help="the query bank's softmax temperature")] = 1.0,
    rank_hard: Annotated[int, typer.Option(help="itm_rank: negatives of a group drawn from the 20 scenes that share "
                                                "most of the caption's objects")] = 5,
    rank_partial: Annotated[int, typer.Option(help="itm_rank: negatives drawn from the scenes made of a part of the "
                                                   "caption's objects (the rest of the group's 7 are random)")] = 0,
    warmup: Annotated[int, typer.Option(min=0, help="linear warm-up steps, then linear decay to 0")] = 100,
    clip: Annotated[float, typer.Option(min=0.0, help="gradient norm clip")] = 1.0,
    vqa_loss: Annotated[str, typer.Option(help="bce (soft scores, the VQA standard) or ce (softmax; faster on single-answer data)")] = "bce",
    freeze_word_embeddings: Annotated[bool, typer.Option(help="keep the word-embedding table fixed (about 1.2x faster steps)")] = False,
    vqa_pool: Annotated[str, typer.Option(help="pooled (CLS), answer_slot ([MASK] before the last [SEP]), answer_segment (VL-BERT's [SEP] [MASK] [SEP]), regions (pooled + attention over regions), regions_geometry (regions + the boxes of question-located regions), regions_count (regions + counts of the regions the question fits) or regions_film (regions + counts + located boxes, modulated by the question)")] = "pooled",
    itm_pool: Annotated[str, typer.Option(help="pooled (CLS) or regions (pooled + attention over regions)")] = "pooled",
    nlvr2_pool: Annotated[str, typer.Option(help="pooled (CLS) or regions, for each image of the pair")] = "pooled",
    rank_pool: Annotated[str | None, typer.Option(help="pooled or regions: itm_rank / itm_rank_text train a ranking "
                                                       "head of their own (head 'rank', which /retrieve then reads) "
                                                       "instead of the itm head")] = None,
    bf16: Annotated[bool, typer.Option(help="bfloat16 autocast (about 1.5x faster on CPUs with AVX512-BF16)")] = False,
    dropout: Annotated[float | None, typer.Option(help="hidden and attention dropout (default: the preset's 0.1); 0 "
                                                       "makes CPU steps faster")] = None,
    feature_norm: Annotated[bool, typer.Option(help="standardise region features with the training regions' statistics")] = True,
    box_embedding: Annotated[str, typer.Option(help=BOX_EMBEDDING_HELP)] = "linear",
    region_tags: Annotated[bool, typer.Option(help="u-visualbert: each region also carries its detector class word, as in "
                                                   "its pretraining (and so at inference: the service feeds them too)")] = False,
    seed: Annotated[int, typer.Option()] = 0,
    threads: Annotated[int, typer.Option(min=1)] = 2,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N: where the model trains (batches are collated on the "
                                             "CPU; metrics and the checkpoint come back to it)")] = "cpu",
) -> None:
    """Multi-task fine-tuning: one shared encoder with vqa, refer, itm, nlvr2 and multiple_choice heads."""
    from training.finetune import FinetuneConfig, train

    try:
        weights = {name: float(w) for name, w in (item.split(":") for item in tasks.split(","))}
        cfg = FinetuneConfig(out=out, detector_dir=detector, preset=preset, size=size, num_layers=num_layers,
                             tasks=weights, steps=steps,
                             batch_size=batch_size, lr=lr, head_lr=head_lr, train_scenes=train_scenes,
                             eval_scenes=eval_scenes, easy_vqa=easy_vqa, init_text=init_text, init_from=init_from,
                             eval_every=eval_every, retrieval_queries=retrieval_queries, retrieval_pool=retrieval_pool,
                             query_bank=query_bank,
                             query_bank_temperature=query_bank_temperature, rank_hard=rank_hard,
                             rank_partial=rank_partial, warmup=warmup, clip=clip, vqa_loss=vqa_loss, vqa_pool=vqa_pool, bf16=bf16,
                             itm_pool=itm_pool, nlvr2_pool=nlvr2_pool, rank_pool=rank_pool,
                             lead_tasks=tuple(t.strip() for t in lead_tasks.split(",") if t.strip()), lead_steps=lead_steps,
                             lead_retries=lead_retries,
                             curriculum=parse_curriculum(curriculum),
                             freeze_word_embeddings=freeze_word_embeddings, dropout=dropout,
                             feature_norm=feature_norm, box_embedding=box_embedding, region_tags=region_tags,
                             seed=seed, threads=threads, device=device)
        validate_finetune(cfg)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    metrics = train(cfg)
    typer.echo(json.dumps({"out": str(out), "final": metrics["final"], "train_seconds": metrics["train_seconds"]}, indent=2))


@app.command("pretrain")
def pretrain(
    out: Annotated[Path, typer.Option(help="encoder checkpoint directory to write (resumed if it holds train_state.pt)")],
    detector: Annotated[Path, typer.Option(help="detector checkpoint directory (regions are extracted once and cached)")],
    preset: Annotated[str, typer.Option(help="visualbert, vl-bert, vilbert, lxmert or u-visualbert")] = "visualbert",
    size: Annotated[str, typer.Option(help="tiny, small or base")] = "small",
    num_layers: Annotated[int | None, typer.Option(min=1, help="encoder (text) layers (default: the size's; small: "
                                                               "MiniLM's 6, fewer start from its first layers)")] = None,
    objectives: Annotated[str, typer.Option(help="comma-separated: mlm, mrfr, mrc, mrc_kl, itm, image_qa, tag, weak "
                                                 "(default: the preset's paper objectives)")] = "",
    steps: Annotated[int, typer.Option(min=1)] = 2000,
    batch_size: Annotated[int, typer.Option(min=1)] = 32,
    lr: Annotated[float, typer.Option(min=0.0, help="encoder peak learning rate")] = 1e-4,
    head_lr: Annotated[float, typer.Option(min=0.0, help="heads' peak learning rate")] = 1e-4,
    warmup: Annotated[int, typer.Option(min=0, help="linear warm-up steps, then linear decay to 0")] = 100,
    clip: Annotated[float, typer.Option(min=0.0, help="gradient norm clip")] = 1.0,
    mask_prob: Annotated[float, typer.Option(help="text tokens masked")] = 0.15,
    mlm_words: Annotated[str, typer.Option(help="masked LM targets: all words, or grounded: only the detector's class "
                                                "and attribute names, which only the image decides")] = "all",
    mlm_matched_only: Annotated[bool, typer.Option(help="with itm: no masked LM target in a mismatched pair (UNITER)")] = False,
    region_mask_prob: Annotated[float, typer.Option(help="regions masked")] = 0.15,
    visual_feat_dim: Annotated[int | None, typer.Option(help="expected region feature width (default: the detector's)")] = None,
    train_scenes: Annotated[int, typer.Option(min=1)] = 20_000,
    eval_scenes: Annotated[int, typer.Option(min=1, help="val scenes for the final zero-shot ITM accuracy")] = 500,
    easy_vqa: Annotated[bool, typer.Option(help="add easy-VQA images and questions (image QA)")] = True,
    init_text: Annotated[bool, typer.Option(help="start the text side from MiniLM (size small)")] = True,
    bf16: Annotated[bool, typer.Option(help="bfloat16 autocast (about 1.5x faster on CPUs with AVX512-BF16)")] = False,
    feature_norm: Annotated[bool, typer.Option(help="standardise region features with the training regions' statistics")] = True,
    box_embedding: Annotated[str, typer.Option(help=BOX_EMBEDDING_HELP)] = "linear",
    seed: Annotated[int, typer.Option()] = 0,
    threads: Annotated[int, typer.Option(min=1)] = 2,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N: where the model trains (batches are collated on the "
                                             "CPU; metrics and the checkpoint come back to it)")] = "cpu",
) -> None:
    """Pretrain an encoder preset with its paper's objectives (weak mode for u-visualbert) on cached regions."""
    from training.pretrain import PretrainConfig, PretrainConfigError
    from training.pretrain import pretrain as run_pretrain

    cfg = PretrainConfig(out=out, detector_dir=detector, preset=preset, size=size, num_layers=num_layers, init_text=init_text,
                         objectives=tuple(o.strip() for o in objectives.split(",") if o.strip()),
                         visual_feat_dim=visual_feat_dim, easy_vqa=easy_vqa, train_scenes=train_scenes,
                         eval_scenes=eval_scenes, steps=steps, batch_size=batch_size, lr=lr, head_lr=head_lr,
                         warmup=warmup, clip=clip, mask_prob=mask_prob, region_mask_prob=region_mask_prob,
                         mlm_words=mlm_words, mlm_matched_only=mlm_matched_only, bf16=bf16, feature_norm=feature_norm, box_embedding=box_embedding, seed=seed, threads=threads,
                         device=device)
    try:
        metrics = run_pretrain(cfg)  # validates the config, then the data, before the first step
    except PretrainConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps({"out": str(out), "objectives": list(cfg.objectives), "final": metrics["final"],
                           "last": metrics["history"][-1], "train_seconds": metrics["train_seconds"]}, indent=2))


def parse_curriculum(text: str) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """'positions_one_side=200,refer+positions=100' -> ((200, ('positions_one_side',)), (100, ('refer', 'positions')))."""
    phases = []
    for item in filter(None, (i.strip() for i in text.split(","))):
        tasks, _, steps = item.partition("=")
        if not steps.strip().isdigit():
            raise ValueError(f"--curriculum item {item!r} is not TASKS=STEPS (e.g. positions_one_side=200)")
        phases.append((int(steps), tuple(t.strip() for t in tasks.split("+") if t.strip())))
    return tuple(phases)


def validate_finetune(cfg) -> None:
    """Fail before any data is prepared: unknown preset/size/task, missing detector, an --init-from checkpoint of
    another preset, size or feature dim."""
    from models.checkpoint import CheckpointError, load_checkpoint
    from models.config import HEAD_POOLS
    from models.detector.io import load_detector
    from models.registry import encoder_config
    from training.finetune import RANK_TASKS, TASKS, TRAINING_SETS, check_lead, training_tasks
    from training.device import resolve_device

    resolve_device(cfg.device)  # an unknown device, or a GPU torch cannot see

    layers = {} if cfg.num_layers is None else {"num_layers": cfg.num_layers}
    encoder = encoder_config(cfg.preset, cfg.size, box_embedding=cfg.box_embedding, region_tags=cfg.region_tags, **layers)  # unknown preset, size, ...
    if cfg.vqa_loss not in ("bce", "ce"):
        raise ValueError(f"--vqa-loss must be bce or ce, not {cfg.vqa_loss!r}")
    if cfg.vqa_pool not in HEAD_POOLS:
        raise ValueError(f"--vqa-pool must be {', '.join(HEAD_POOLS[:-1])} or {HEAD_POOLS[-1]}, not {cfg.vqa_pool!r}")
    for name, pool in (("--itm-pool", cfg.itm_pool), ("--nlvr2-pool", cfg.nlvr2_pool), ("--rank-pool", cfg.rank_pool or "pooled")):
        if pool not in ("pooled", "regions"):
            raise ValueError(f"{name} must be pooled or regions, not {pool!r}")
    if cfg.rank_pool and not set(training_tasks(cfg)) & set(RANK_TASKS):
        raise ValueError("--rank-pool names the ranking head's pool: add itm_rank or itm_rank_text to --tasks")
    unknown = set(cfg.tasks) - {*TASKS, *TRAINING_SETS}
    if unknown:
        raise ValueError(f"head not supported by fine-tuning: {', '.join(sorted(unknown))} (choose {', '.join((*TASKS, *TRAINING_SETS))})")
    if cfg.dropout is not None and not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1), not {cfg.dropout}")
    if any(w <= 0 for w in cfg.tasks.values()):
        raise ValueError("task weights must be positive")
    check_lead(cfg)
    if cfg.init_text and cfg.init_from is None and cfg.size != "small":
        raise ValueError("--init-text needs size small (MiniLM has hidden size 384)")
    try:
        detector, _ = load_detector(cfg.detector_dir)
    except CheckpointError as exc:
        raise ValueError(f"detector: {exc}") from None
    if cfg.init_from is not None:
        try:
            source = load_checkpoint(cfg.init_from, preset=cfg.preset, size=cfg.size, visual_feat_dim=detector.config.feature_dim)
        except CheckpointError as exc:
            raise ValueError(f"--init-from: {exc}") from None
        theirs = source.model.config.encoder.box_embedding
        if theirs != cfg.box_embedding:
            raise ValueError(f"--init-from: encoder.box_embedding is {theirs!r}, expected {cfg.box_embedding!r} (pass --box-embedding {theirs})")
        if source.model.config.encoder.num_layers != encoder.num_layers:
            raise ValueError(f"--init-from: the encoder has {source.model.config.encoder.num_layers} layers, the run "
                             f"{encoder.num_layers} (pass --num-layers {source.model.config.encoder.num_layers})")
