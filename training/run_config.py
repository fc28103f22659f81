"""The fields every training run shares (`RunConfig`), and the command-line options built from run configs' fields.

Each field is written once, with its default and help (`option`); `config_command` turns a config dataclass into a
typer command's options (name, type, default, help, bounds; the choices of a `Literal` type in the help; a float
option is finite), as vLLM builds its engine arguments from its config classes. Adding a field to a run config adds
its option.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

Preset = Literal["visualbert", "vl-bert", "vilbert", "lxmert", "u-visualbert"]
Size = Literal["tiny", "small", "base"]
BoxEmbedding = Literal["linear", "normalized"]
EmbeddingStyle = Literal["published", "vlserve"]  # models.config.EMBEDDING_STYLES


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
           flag: str | None = None, min: float | None = None, max: float | None = None,
           parse: Callable[[str], Any] | None = None, show: Callable[[Any], str] | None = None) -> Any:
    """A config field with its command-line option: `help` documents the field; `flag` renames the option (default:
    the field's name); `min` and `max` bound it; a field whose type has no option type of its own is given as a string
    (`show` writes the default, `parse` reads it back)."""
    metadata = {"help": help, "flag": flag, "min": min, "max": max, "parse": parse, "show": show}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def finite(value: float | None) -> float | None:
    """A float option's callback: no nan or inf (a learning rate or loss weight of inf trains NaN weights)."""
    import typer

    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"must be a finite number, not {value}")
    return value


def finite_within(min: float | None = None, max: float | None = None) -> Callable[[float | None], float | None]:
    """A bounded float option's callback: finite first (click's own bounds check would call nan "not >= 0"), then
    within [min, max], in the words click uses for its bounds."""
    import typer

    def check(value: float | None) -> float | None:
        value = finite(value)
        if value is not None and min is not None and value < min:
            raise typer.BadParameter(f"Input should be greater than or equal to {min:g}")
        if value is not None and max is not None and value > max:
            raise typer.BadParameter(f"Input should be less than or equal to {max:g}")
        return value
    return check


# torch.set_num_threads takes a C int; more threads than any machine here has cores only oversubscribes it
MAX_THREADS = 1024
# torch.manual_seed takes up to 2**64 - 1; a 32-bit seed leaves room for the seed + n of a restarted run
MAX_SEED = 2**32 - 1


def embedding_override(cfg) -> dict[str, str]:
    """The encoder-config field a run's --embedding-style sets (none: the preset's)."""
    return {} if cfg.embedding_style is None else {"embedding_style": cfg.embedding_style}


def names(text: str) -> tuple[str, ...]:
    """'a, b,c' -> ('a', 'b', 'c')."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


@dataclass
class RunConfig:
    """What every encoder run (pretraining, fine-tuning) is configured by."""
    out: Path = option(Path("run"), "checkpoint directory to write (resumed if it holds train_state.pt)")
    detector_dir: Path = option(Path("detector"), "detector checkpoint directory (regions are extracted once and cached)",
                                flag="detector")
    # the command's check of --out reads it; the run itself writes wherever it is sent
    force: bool = option(False, "write over the finished model or detector --out holds (its files are replaced); "
                                "without it such an --out is refused")
    preset: Preset = option("visualbert", "encoder preset")
    size: Size = option("small", "encoder size (small: the text side from MiniLM)")
    num_layers: int | None = option(None, "encoder (text) layers (default: the size's; small: MiniLM's 6, fewer start "
                                          "from its first layers)", min=1)
    init_text: bool = option(True, "start the text side from MiniLM (size small)")
    bf16: bool = option(False, "bfloat16 autocast where the CPU has native bf16 (about 1.5x faster with AVX512-BF16) or "
                               "the GPU has it; float32 elsewhere, where emulated bf16 is several times slower")
    feature_norm: bool = option(True, "standardise region features with the training regions' statistics")
    box_embedding: BoxEmbedding = option("linear", "u-visualbert: linear (Linear(4, H) summed with the features) or "
                                                   "normalized (layer-normalised sin/cos box geometry beside the "
                                                   "layer-normalised features, as LXMERT; embedding style vlserve)")
    embedding_style: EmbeddingStyle | None = option(None, "u-visualbert: published (the preset's: its authors' "
                                                          "embeddings, detector tags as sub-word tokens after the regions) "
                                                          "or vlserve (VisualBERT's, tags summed into the regions)")
    easy_vqa: bool = option(True, "add easy-VQA's training images and questions")
    easy_vqa_images: int | None = option(None, "use only the first N easy-VQA training images (default: all 4,000)", min=0)
    train_scenes: int = option(20_000, "shapes-world training scenes", min=1)
    eval_scenes: int = option(1_000, "shapes-world val scenes evaluated", min=1)
    steps: int = option(2000, "optimizer steps", min=1)
    batch_size: int = option(32, "examples per step", min=1)
    lr: float = option(1e-4, "encoder peak learning rate", min=0.0)
    head_lr: float = option(1e-3, "heads' peak learning rate", min=0.0)
    warmup: int = option(100, "linear warm-up steps, then linear decay to 0", min=0)
    weight_decay: float = option(0.01, "AdamW weight decay", min=0.0)
    clip: float = option(1.0, "gradient norm clip", min=0.0)
    checkpoint_every: int = option(250, "steps between resumable-state saves", min=1)
    seed: int = option(0, "seed of data order and initialisation", min=0, max=MAX_SEED)
    threads: int = option(2, "torch threads", min=1, max=MAX_THREADS)
    device: str = option("cpu", "cpu, cuda or cuda:N: where the model runs (batches are collated on the CPU; metrics "
                                "and checkpoints come back to it)")
    max_length: int = option(40, "text tokens", min=1)


TASKS_HELP = ("comma-separated task:weight list over vqa, refer, itm, nlvr2, multiple_choice and itm_rank / itm_rank_text "
              "(retrieval groups, a listwise ranking loss through the itm head: a caption with 8 images / an image with its "
              "listing and 7 near-miss listings), and the question sets trained through the vqa head: positions / "
              "positions_one_side (one-object positions), relations and attributes (every relation or attribute question "
              "of a training scene), related_attributes (attribute questions about objects named through a relation that "
              "decides); related_refer (such expressions, through the refer head)")


def parse_tasks(text: str) -> dict[str, float]:
    """'vqa:1,refer:0.5' -> {'vqa': 1.0, 'refer': 0.5}."""
    try:
        pairs = [(name.strip(), float(w)) for name, w in (item.split(":") for item in names(text))]
    except ValueError:
        raise ValueError(f"--tasks {text!r} is not a task:weight list (e.g. vqa:1,refer:1)") from None
    twice = sorted({name for name, _ in pairs if [n for n, _ in pairs].count(name) > 1})
    if twice:
        raise ValueError(f"--tasks {text!r} names {', '.join(twice)} more than once: give each task one weight")
    return dict(pairs)


def parse_curriculum(text: str) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """'positions_one_side=200,refer+positions=100' -> ((200, ('positions_one_side',)), (100, ('refer', 'positions')))."""
    phases = []
    for item in names(text):
        tasks, _, steps = item.partition("=")
        if not steps.strip().isdigit():
            raise ValueError(f"--curriculum item {item!r} is not TASKS=STEPS (e.g. positions_one_side=200)")
        phases.append((int(steps), tuple(t.strip() for t in tasks.split("+") if t.strip())))
    return tuple(phases)


HeadPool = Literal["pooled", "answer_slot", "answer_segment", "regions", "regions_film"]  # models.config.HEAD_POOLS
RegionPool = Literal["pooled", "regions"]


@dataclass
class FinetuneConfig(RunConfig):
    """A multi-task fine-tuning run: one shared encoder, a head per task, tasks sampled by weight per step."""
    out: Path = option(Path("encoder"), "encoder checkpoint directory to write (resumed if it holds train_state.pt)")
    tasks: dict[str, float] = option(factory=lambda: {"vqa": 1.0, "refer": 1.0, "itm": 1.0, "nlvr2": 1.0}, help=TASKS_HELP,
                                     parse=parse_tasks, show=lambda t: ",".join(f"{k}:{w:g}" for k, w in t.items()))
    # a grounding curriculum: refer learns word-region binding alone in ~200 steps, but not while four fresh heads
    # share the encoder
    lead_tasks: tuple[str, ...] = option((), "comma-separated tasks trained alone for the first --lead-steps steps (a "
                                             "grounding curriculum, e.g. refer)", parse=names, show=",".join)
    lead_steps: int = option(0, "steps of the lead phase (0: every task from the start)", min=0)
    # The lead phase exists to get its tasks off their plateau, and when they leave it depends on rounding (from step
    # 60 to past 200 over seeds and AdamW kernels): a lead whose mean loss over its last training.finetune.LEAD_WINDOW
    # steps is not below lead_takeoff x its first ones' is stalled, and the run starts again (then goes on, warned).
    lead_retries: int = option(0, "a lead phase whose loss has not fallen below --lead-takeoff x its start starts the run "
                                  "again with the next seed, this many times", min=0)
    lead_takeoff: float = option(0.8, "the loss ratio (end / start of the lead phase) a lead phase must fall below", min=0.0)
    curriculum: tuple[tuple[int, tuple[str, ...]], ...] = option(
        (), "phases after the lead phase, in order, as TASKS=STEPS items (TASKS joined by +), e.g. "
            "positions_one_side=200,positions=200: one-object position questions through the vqa head; a phase's tasks "
            "need not be in --tasks (then they are not part of the mix after it)",
        parse=parse_curriculum, show=lambda c: ",".join(f"{'+'.join(tasks)}={n}" for n, tasks in c))
    vqa_pool: HeadPool = option("pooled", "what the VQA head reads: pooled (CLS), answer_slot ([MASK] before the last "
                                          "[SEP]), answer_segment (VL-BERT's [SEP] [MASK] [SEP]), regions (pooled + "
                                          "attention over regions) or regions_film (regions + counts + located boxes, "
                                          "modulated by the question)")
    vqa_loss: Literal["bce", "ce"] = option("bce", "bce (soft scores, the VQA standard) or ce (softmax; single-answer "
                                                   "data learns faster)")
    itm_pool: RegionPool = option("pooled", "pooled (CLS) or regions (pooled + attention over regions)")
    nlvr2_pool: RegionPool = option("pooled", "pooled (CLS) or regions, for each image of the pair")
    rank_pool: RegionPool | None = option(None, "pooled or regions: itm_rank / itm_rank_text train a ranking head of their "
                                                "own (head 'rank', which /retrieve then reads) instead of the itm head")
    freeze_word_embeddings: bool = option(False, "keep the word-embedding table fixed: no dense AdamW update of 30522 x H "
                                                 "per step (about 1.2x faster steps)")
    dropout: float | None = option(None, "hidden and attention dropout (default: the preset's 0.1); 0 makes CPU steps faster")
    region_tags: bool = option(False, "u-visualbert: each region also carries its detector class word, as in its "
                                      "pretraining (and so at inference: the service feeds them too)")
    init_from: Path | None = option(None, "start the encoder (and same-named, same-shaped heads) from this checkpoint, e.g. "
                                          "a pretraining run")
    eval_every: int = option(500, "steps between periodic evaluations", min=1)
    eval_examples: int = option(500, "examples per task of a periodic evaluation", min=1)
    final_eval_examples: int | None = option(None, "examples per eval set of the final evaluation (default: all)", min=1)
    retrieval_queries: int = option(0, "final text -> image R@1/5/10 of this many listing captions over the eval pool (0: "
                                       "none; queries x pool pairs are scored)", min=0)
    retrieval_pool: int | None = option(None, "rank over the first this many eval scenes instead of all: with a query bank "
                                              "each is also scored with every bank caption")
    query_bank: int = option(0, "keep this many listing captions of the itm_rank groups as the checkpoint's query bank: "
                                "/retrieve and R@K then rank each image's score against its scores with them "
                                "(models.query_bank; 0: raw scores)", min=0)
    query_bank_temperature: float = option(1.0, "the query bank's softmax temperature")
    rank_hard: int = option(5, "itm_rank: negatives of a group drawn from the 20 scenes that share most of the caption's "
                               "objects")
    rank_partial: int = option(0, "itm_rank: negatives drawn from the scenes made of a part of the caption's objects (the "
                                  "rest of the group's 7 are random)")


DEFAULT_OBJECTIVES = {  # each paper's pretraining tasks (PretrainConfig.objectives)
    "visualbert": ("mlm", "itm"),  # masked LM with the image + sentence-image prediction
    "vl-bert": ("mlm", "mrc"),  # masked LM + masked RoI classification with linguistic clues; no ITM (it hurt)
    "vilbert": ("mlm", "mrc_kl", "itm"),  # masked multi-modal modelling (KL) + multi-modal alignment
    "lxmert": ("mlm", "mrfr", "mrc", "itm", "image_qa"),
    "u-visualbert": ("weak",),  # unpaired text and images, detector tags as anchors
}
MLM_WORDS = ("all", "grounded")  # PretrainConfig.mlm_words


@dataclass
class PretrainConfig(RunConfig):
    """A pretraining run: the preset's paper objectives over cached regions."""
    out: Path = option(Path("pretrained"), "encoder checkpoint directory to write (resumed if it holds train_state.pt)")
    objectives: tuple[str, ...] = option((), "comma-separated: mlm, mrfr, mrc, mrc_kl, itm, image_qa, tag, weak (default: "
                                             "the preset's paper objectives)", parse=names, show=",".join)
    eval_scenes: int = option(500, "val scenes for the final zero-shot ITM accuracy", min=1)
    head_lr: float = option(1e-4, "pretraining heads' peak learning rate", min=0.0)
    visual_feat_dim: int | None = option(None, "expected region feature width (default: the detector's; anything else is "
                                               "an error)")
    mask_prob: float = option(0.15, "text tokens masked (BERT's 80/10/10)")
    mlm_words: Literal[MLM_WORDS] = option("all", "masked LM targets: all words, or grounded: only the detector's class and "
                                                  "attribute names, which only the image decides")
    mlm_matched_only: bool = option(False, "with itm: no masked LM target in a mismatched pair (UNITER's conditional "
                                           "masking)")
    region_mask_prob: float = option(0.15, "regions masked (LXMERT, ViLBERT)")
    mismatch_prob: float = option(0.5, "itm: pairs whose image is swapped for another one")
    image_qa_batches: float = option(0.5, "image_qa: share of steps whose sentences are questions (the rest captions)")
    log_every: int = option(50, "steps per logged loss average", min=1)
    eval_examples: int | None = option(2000, "held-out ITM examples evaluated at the end: the first N of the "
                                             "--eval-scenes' ones", min=1)

    def __post_init__(self) -> None:
        self.objectives = tuple(self.objectives) or DEFAULT_OBJECTIVES.get(self.preset, ())


def choices(annotation: Any) -> tuple[str, ...]:
    """The values of a Literal type (or of the Literal in `Literal[...] | None`); () for any other type."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next((choices(a) for a in typing.get_args(annotation) if choices(a)), ())
    return ()


def field_choices(cls: type, name: str) -> tuple[str, ...]:
    """The allowed values of a config field with a Literal type."""
    return choices(typing.get_type_hints(cls)[name])


def _option_type(annotation: Any) -> Any:
    """The type typer parses a field as: a Literal as str (its values are checked, and named, by the config's
    validation), `X | None` as `X | None`."""
    if choices(annotation):
        return str | None if type(None) in typing.get_args(annotation) else str
    return annotation


def _parameter(f: dataclasses.Field, hint: Any, required: bool) -> inspect.Parameter:
    import typer

    meta = f.metadata
    allowed = choices(hint)
    text = meta.get("help", "")
    if allowed and not all(value in text for value in allowed):
        text += f" (one of {', '.join(allowed)})"
    decls = [f"--{meta['flag'].replace('_', '-')}"] if meta.get("flag") else []
    checks = {name: meta[name] for name in ("min", "max") if meta.get(name) is not None}
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if meta.get("parse"):
        kind, default = str, meta["show"](default)
    else:
        kind = _option_type(hint)
    if kind in (float, float | None):  # finite, then bounded: nan is "not finite", not "below min"
        checks = {"callback": finite_within(checks.get("min"), checks.get("max"))}
    annotation = Annotated[kind, typer.Option(*decls, help=text, **checks)]
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=inspect.Parameter.empty if required else default)


def config_command(cls: type, *, required: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
                   build: bool = True) -> Callable:
    """Decorate a typer command: its options are its own parameters plus one per field of `cls` (or of `only`).
    With `build`, the command is `command(cfg, **own)` and is called with `cls(**those fields)` (a ValueError while a
    field's string is read exits 2); without, it takes the fields as parameters of those names."""
    import typer

    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if only is None or f.name in only]
    generated = [_parameter(f, hints[f.name], f.name in required) for f in fields]

    def decorate(command: Callable) -> Callable:
        skip = {"cfg"} if build else {f.name for f in fields}
        own = [p for name, p in inspect.signature(command, eval_str=True).parameters.items() if name not in skip]

        @functools.wraps(command)
        def run(**values):
            if not build:
                return command(**values)
            config = {f.name: values.pop(f.name) for f in fields}
            try:
                for f in fields:
                    if f.metadata.get("parse"):
                        config[f.name] = f.metadata["parse"](config[f.name])
            except ValueError as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from None
            return command(cls(**config), **values)

        run.__signature__ = inspect.Signature([*own, *generated])
        run.__annotations__ = {p.name: p.annotation for p in run.__signature__.parameters.values()}
        del run.__wrapped__  # typer reads the generated signature, not the command's
        return run

    return decorate
