"""Everything a fine-tuning run or an evaluation reads: region tables (extracted once per detector) and task examples."""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.detector import DetectorConfig
from models.detector.io import load_detector

from .data.easy_vqa import load_easy_vqa, load_image as load_easy_vqa_image
from .data.region_table import RegionTable, extract_table
from .data.shapes_cache import FORMAT_VERSION, ShapesConfig, ShapesSplit, cache_root, config_hash, load_split
from .data.shapes_tasks import (
    ANSWERS, ONE_SIDE, SIDES, TaskConfig, all_attribute_questions, position_questions, related_attribute_questions,
    related_expressions, relation_questions,
)
from .data.shapes_world import WorldConfig
from .data.vl_tasks import (
    Example, caption_ranking_examples, easy_vqa_examples, expression_examples, question_examples, ranking_examples, retrieval_examples, shapes_examples,
)
from .data.vl_tasks import easy_vqa_images as easy_vqa_image_ids
from .device import resolve_device

# question sets trained as tasks through the VQA head, beyond a scene's sampled VQA questions: one-object position
# questions (shapes_tasks.position_questions, both-sided and one-sided), and every relation and every attribute
# question a scene has (its VQA questions sample vqa_per_type of each kind), and attribute questions about objects
# named through a relation that decides ("what color is the shape left of the red circle?")
QUESTION_SETS = {"positions": functools.partial(position_questions, sides=tuple(SIDES)),
                 "positions_one_side": functools.partial(position_questions, sides=ONE_SIDE),
                 "relations": relation_questions, "attributes": all_attribute_questions,
                 "related_attributes": related_attribute_questions}
# expression sets trained as tasks through the refer head: objects named through a relation that decides (a split's
# expressions use a relation only where nothing shorter fits the object alone)
EXPRESSION_SETS = {"related_refer": related_expressions}
Extract = Callable[[str, Callable[[int], np.ndarray], int], RegionTable]  # (cache name, load image i, count)


@dataclass
class TaskData:
    train_table: RegionTable | None  # shapes train scenes, then easy-VQA train images (None: evaluation only)
    eval_table: RegionTable  # shapes val (or test) scenes, then easy-VQA test images
    train: dict[str, list[Example]]  # task -> examples over train_table
    eval: dict[str, list[Example]]  # eval set (vqa, refer, itm, nlvr2, mc, easy_vqa, retrieval) -> examples over eval_table
    answers: list[str]
    objects: list[str]
    attributes: list[str]
    fingerprint: str
    feature_dim: int


def tagged(data: TaskData, model, tokenizer) -> TaskData:
    """The data as `model` reads it: with each region's detector class word as its tag (every sub-word of it for
    u-visualbert's published embeddings) when the encoder was trained with region tags (EncoderConfig.region_tags),
    unchanged otherwise."""
    encoder = model.config.encoder
    if not encoder.region_tags:
        return data
    words = tokenizer.tag_table(data.objects, encoder.embedding_style)
    train = None if data.train_table is None else data.train_table.with_tags(words)
    return dataclasses.replace(data, train_table=train, eval_table=data.eval_table.with_tags(words))


def concat_tables(tables: list[RegionTable]) -> RegionTable:
    whole = [t.image_feature for t in tables]
    return RegionTable(
        features=np.concatenate([t.features for t in tables]),
        boxes=np.concatenate([t.boxes for t in tables]),
        pixel_boxes=np.concatenate([t.pixel_boxes for t in tables]),
        mask=np.concatenate([t.mask for t in tables]),
        obj_ids=np.concatenate([t.obj_ids for t in tables]),
        image_feature=None if any(w is None for w in whole) else np.concatenate(whole),
    )


def shapes_config_from_dir(path: Path) -> tuple[ShapesConfig, Path]:
    """The config of a built shapes-world dataset directory (`.../shapes/<hash>`) and its cache root."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
        world = WorldConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw["world"].items()})
        config = ShapesConfig(world=world, tasks=TaskConfig(**raw["tasks"]), splits=tuple(tuple(s) for s in raw["splits"]))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a shapes-world dataset directory ({exc})") from None
    if raw.get("format") != FORMAT_VERSION or config_hash(config) != path.name:
        raise ValueError(f"{path}: shapes-world dataset of another format version or a renamed directory")
    return config, path.parent.parent


def shapes_part(extract: Extract, split_name: str, scenes: int, data: ShapesConfig, seed: int, retrieval_pool: int = 0,
                root: Path | None = None, ranking: bool = False, question_sets: tuple[str, ...] = (),
                rank_groups: dict | None = None) -> tuple[RegionTable, dict[str, list[Example]]]:
    """Regions of the first max(scenes, retrieval_pool) scenes of a split; task examples of the first `scenes`
    (NLVR2 pairs inside them), with `ranking` the retrieval training groups (itm_rank, itm_rank_text) over them, with
    `question_sets` the named sets of QUESTION_SETS and EXPRESSION_SETS, and, with retrieval_pool, one gold
    caption for each of the first pool scenes. rank_groups: ranking_examples' negatives (hard, partial)."""
    split = load_split(split_name, data, root)
    scenes, pool = min(scenes, len(split)), min(retrieval_pool, len(split))
    table = extract(f"shapes-{config_hash(data)}-{split_name}", lambda i: np.asarray(split.image(i)), max(scenes, pool))
    inside = lambda pair: all(int(pair[side].split("/")[1]) < scenes for side in ("left", "right"))  # noqa: E731
    examples = shapes_examples(ShapesSplit(split.directory, split.annotations[:scenes], list(filter(inside, split.nlvr2))),
                               ANSWERS, seed=seed)
    if ranking:
        scene_split = ShapesSplit(split.directory, split.annotations[:scenes], [])
        examples["itm_rank"] = ranking_examples(scene_split, seed=seed, **(rank_groups or {}))
        examples["itm_rank_text"] = caption_ranking_examples(scene_split, seed=seed)
    for name in question_sets:
        scene_split = ShapesSplit(split.directory, split.annotations[:scenes], [])
        examples[name] = (question_examples(scene_split, ANSWERS, QUESTION_SETS[name]) if name in QUESTION_SETS
                          else expression_examples(scene_split, EXPRESSION_SETS[name]))
    if pool:
        examples["retrieval"] = retrieval_examples(ShapesSplit(split.directory, split.annotations[:pool], []))
    return table, examples


def easy_vqa_part(extract: Extract, split_name: str, images: int | None, row_offset: int) -> tuple[RegionTable, list[Example]]:
    """Regions and VQA examples of the first `images` easy-VQA images of a split (None = all)."""
    split = load_easy_vqa(split_name)
    if images is not None:
        keep = set(easy_vqa_image_ids(split)[:images])
        split.image_paths = {i: p for i, p in split.image_paths.items() if i in keep}
        split.examples = [e for e in split.examples if e.image_id in keep]
    ids = easy_vqa_image_ids(split)
    table = extract(f"easy-vqa-{split_name}", lambda i: load_easy_vqa_image(split.image_paths[ids[i]]), len(ids))
    return table, easy_vqa_examples(split, ANSWERS, row_offset=row_offset)


def as_eval_sets(examples: dict[str, list[Example]]) -> dict[str, list[Example]]:
    """Eval sets are named by their metric: multiple choice reports mc_acc."""
    return {("mc" if task == "multiple_choice" else task): exs for task, exs in examples.items()}


def _extractor(detector_dir: Path, progress: bool, device: str = "cpu") -> tuple[DetectorConfig, str, Extract]:
    """The detector's config, its fingerprint, and a cached region extractor (features/<fingerprint>/<name>.vlfeat)
    that runs the detector on `device` (a GPU's regions are the CPU's; features within about 1e-3, the float16 they
    are stored in: docs/BENCHMARKS.md "GPU")."""
    detector, fingerprint = load_detector(detector_dir)
    detector.to(resolve_device(device))
    features_dir = cache_root() / "features" / fingerprint

    def extract(name: str, load_image: Callable[[int], np.ndarray], count: int) -> RegionTable:
        return extract_table(detector, fingerprint, load_image, count, features_dir / f"{name}.vlfeat", progress=progress)

    return detector.config, fingerprint, extract


def prepare_task_data(detector_dir: Path, train_scenes: int, eval_scenes: int, easy_vqa: bool = True,
                      progress: bool = True, data: ShapesConfig = ShapesConfig(), easy_vqa_images: int | None = None,
                      shapes_root: Path | None = None, ranking: bool = False, question_sets: bool = False,
                      device: str = "cpu", rank_groups: dict | None = None) -> TaskData:
    """Extract (or load cached) regions for the data a run uses and build its task examples (eval on val);
    with `ranking` also the itm_rank and itm_rank_text training groups, with `question_sets` the QUESTION_SETS
    (trained through the VQA head) and EXPRESSION_SETS (through the refer head); the val scenes' both-sided position
    questions are scored as `positions`. Regions not yet cached are extracted on `device`. rank_groups: the
    negatives of the itm_rank groups (vl_tasks.ranking_examples' hard and partial)."""
    cfg, fingerprint, extract = _extractor(detector_dir, progress, device)
    train_table, train = shapes_part(extract, "train", train_scenes, data, seed=0, root=shapes_root, ranking=ranking,
                                     question_sets=(*QUESTION_SETS, *EXPRESSION_SETS) if question_sets else (),
                                     rank_groups=rank_groups)
    eval_table, evals = shapes_part(extract, "val", eval_scenes, data, seed=1, retrieval_pool=eval_scenes, root=shapes_root,
                                    question_sets=("positions",) if question_sets else ())
    train_tables, eval_tables, evals = [train_table], [eval_table], as_eval_sets(evals)
    if easy_vqa:
        table, examples = easy_vqa_part(extract, "train", easy_vqa_images, row_offset=len(train_table))
        train_tables.append(table)
        train["vqa"] = train["vqa"] + examples
        table, evals["easy_vqa"] = easy_vqa_part(extract, "test", None, row_offset=len(eval_table))
        eval_tables.append(table)
    return TaskData(concat_tables(train_tables), concat_tables(eval_tables), train, evals, list(ANSWERS),
                    list(cfg.classes), list(cfg.attributes), fingerprint, cfg.feature_dim)


def prepare_eval_data(detector_dir: Path, split: str = "test", scenes: int = 1_000, easy_vqa_images: int = 1_000,
                      retrieval_pool: int = 1_000, progress: bool = True, data: ShapesConfig = ShapesConfig(),
                      shapes_root: Path | None = None, device: str = "cpu") -> TaskData:
    """Held-out data only (no training table): a shapes-world split, easy-VQA test images (0 = none), and the
    retrieval pool (the split's first `retrieval_pool` scenes, 0 = none)."""
    if split not in ("val", "test"):
        raise ValueError(f"evaluation split must be val or test, got {split!r}")
    cfg, fingerprint, extract = _extractor(detector_dir, progress, device)
    table, evals = shapes_part(extract, split, scenes, data, seed=1, retrieval_pool=retrieval_pool, root=shapes_root)
    tables, evals = [table], as_eval_sets(evals)
    if easy_vqa_images:
        easy_table, evals["easy_vqa"] = easy_vqa_part(extract, "test", easy_vqa_images, row_offset=len(table))
        tables.append(easy_table)
    return TaskData(None, concat_tables(tables), {}, evals, list(ANSWERS), list(cfg.classes), list(cfg.attributes),
                    fingerprint, cfg.feature_dim)
