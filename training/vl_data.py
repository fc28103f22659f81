"""Everything a fine-tuning run reads: region tables (extracted once per detector) and task examples."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.detector.io import load_detector

from .data.easy_vqa import load_easy_vqa, load_image as load_easy_vqa_image
from .data.region_table import RegionTable, extract_table
from .data.shapes_cache import ShapesConfig, cache_root, config_hash, load_split
from .data.shapes_tasks import ANSWERS
from .data.vl_tasks import Example, easy_vqa_examples, shapes_examples
from .data.vl_tasks import easy_vqa_images as easy_vqa_image_ids


@dataclass
class TaskData:
    train_table: RegionTable  # shapes train scenes, then easy-VQA train images
    eval_table: RegionTable  # shapes val scenes, then easy-VQA test images
    train: dict[str, list[Example]]  # task -> examples over train_table
    eval: dict[str, list[Example]]  # "vqa", "refer", "itm", "nlvr2", "easy_vqa" -> examples over eval_table
    answers: list[str]
    objects: list[str]
    attributes: list[str]
    fingerprint: str
    feature_dim: int


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


def prepare_task_data(detector_dir: Path, train_scenes: int, eval_scenes: int, easy_vqa: bool = True,
                      progress: bool = True, data: ShapesConfig = ShapesConfig(), easy_vqa_images: int | None = None) -> TaskData:
    """Extract (or load cached) regions for the data a run uses and build its task examples."""
    detector, fingerprint = load_detector(detector_dir)
    features_dir = cache_root() / "features" / fingerprint
    shapes_key = config_hash(data)
    train_split, val_split = load_split("train", data), load_split("val", data)
    train_scenes, eval_scenes = min(train_scenes, len(train_split)), min(eval_scenes, len(val_split))
    train_split.annotations = train_split.annotations[:train_scenes]
    val_split.annotations = val_split.annotations[:eval_scenes]
    keep = lambda split, n: [p for p in split.nlvr2 if int(p["left"].split("/")[1]) < n and int(p["right"].split("/")[1]) < n]  # noqa: E731
    train_split.nlvr2, val_split.nlvr2 = keep(train_split, train_scenes), keep(val_split, eval_scenes)

    def table(name: str, loader, count: int) -> RegionTable:
        return extract_table(detector, fingerprint, loader, count, features_dir / f"{name}.vlfeat", progress=progress)

    tables_train = [table(f"shapes-{shapes_key}-train", lambda i: np.asarray(train_split.image(i)), train_scenes)]
    tables_eval = [table(f"shapes-{shapes_key}-val", lambda i: np.asarray(val_split.image(i)), eval_scenes)]
    train = shapes_examples(train_split, ANSWERS, seed=0)
    evals = shapes_examples(val_split, ANSWERS, seed=1)
    if easy_vqa:
        for split_name, tables, target, key in (("train", tables_train, train, "vqa"), ("test", tables_eval, evals, "easy_vqa")):
            split = load_easy_vqa(split_name)
            if split_name == "train" and easy_vqa_images is not None:  # a subset of the training images
                keep_ids = set(easy_vqa_image_ids(split)[:easy_vqa_images])
                split.image_paths = {i: p for i, p in split.image_paths.items() if i in keep_ids}
                split.examples = [e for e in split.examples if e.image_id in keep_ids]
            ids = easy_vqa_image_ids(split)
            offset = sum(len(t) for t in tables)
            tables.append(table(f"easy-vqa-{split_name}", lambda i, ids=ids, split=split: load_easy_vqa_image(split.image_paths[ids[i]]), len(ids)))
            target[key] = target.get(key, []) + easy_vqa_examples(split, ANSWERS, row_offset=offset)
    cfg = detector.config
    return TaskData(concat_tables(tables_train), concat_tables(tables_eval), train, evals, list(ANSWERS),
                    list(cfg.classes), list(cfg.attributes), fingerprint, cfg.feature_dim)
