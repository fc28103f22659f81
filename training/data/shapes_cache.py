"""Shapes-world splits on disk: generated once per config (in parallel), cached outside the repo by config hash."""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from .shapes_tasks import TaskConfig, nlvr2_examples, scene_annotations
from .shapes_world import Scene, WorldConfig, generate_scene, render_scene, scene_from_dict

FORMAT_VERSION = 1  # bump whenever generator or annotation code changes its output: old caches must not be reused
CHUNK = 500  # scenes per worker job; even, so an NLVR2 pair (2k, 2k + 1) never straddles two jobs


@dataclass(frozen=True)
class ShapesConfig:
    """A whole shapes-world dataset: scene look, task annotation counts and split sizes."""

    world: WorldConfig = field(default_factory=WorldConfig)
    tasks: TaskConfig = field(default_factory=TaskConfig)
    splits: tuple[tuple[str, int], ...] = (("train", 20_000), ("val", 2_000), ("test", 2_000))  # (name, scenes)


@dataclass
class ShapesSplit:
    """One cached split: per-scene annotations (scene graph + tasks), NLVR2 pairs, and PNG images."""

    directory: Path
    annotations: list[dict]
    nlvr2: list[dict]

    def __len__(self) -> int:
        return len(self.annotations)

    def image_path(self, index: int) -> Path:
        return self.directory / "images" / f"{index:06d}.png"

    def image(self, index: int) -> Image.Image:
        with Image.open(self.image_path(index)) as image:
            return image.convert("RGB")

    def scene(self, index: int) -> Scene:
        return scene_from_dict(self.annotations[index])


def config_hash(config: ShapesConfig) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, **asdict(config)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_root() -> Path:
    """$VLSERVE_CACHE, else ~/.cache/vlserve: never inside the repository."""
    return Path(os.environ.get("VLSERVE_CACHE") or Path.home() / ".cache" / "vlserve")


def dataset_dir(config: ShapesConfig, root: Path | None = None) -> Path:
    return Path(root or cache_root()) / "shapes" / config_hash(config)


def generate_chunk(job: tuple[ShapesConfig, str, Path, int, int]) -> tuple[str, list[dict], list[dict]]:
    """Scenes [start, stop) of a split: write their PNGs, return their annotations and NLVR2 pairs."""
    config, split, directory, start, stop = job
    annotations, pairs = [], []
    previous = None
    for index in range(start, stop):
        scene = generate_scene(config.world, split, index)
        render_scene(scene).save(directory / "images" / f"{index:06d}.png", compress_level=1)  # speed over size
        annotations.append(scene_annotations(scene, config.tasks))
        if index % 2 == 1:
            pairs += nlvr2_examples(previous, scene, config.tasks)
        previous = scene
    return split, annotations, pairs


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, separators=(",", ":")))


def build_shapes(config: ShapesConfig = ShapesConfig(), root: Path | None = None, workers: int = 2,
                 progress: bool = True) -> Path:
    """Generate and cache every split of config (a no-op when already cached); return the dataset directory."""
    final = dataset_dir(config, root)
    if (final / "config.json").exists():
        return final
    # Build beside the final name and rename at the end: readers never see a half-written set, and a
    # concurrent builder of the same config just loses the race.
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _generate(config, tmp, workers, progress)
    except BaseException:  # a full disk, Ctrl-C: the scenes written so far would hold that space for good
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(final)
    except OSError:  # another process finished the same set first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _generate(config: ShapesConfig, tmp: Path, workers: int, progress: bool) -> None:
    """Every split of config written into tmp, config.json last."""
    jobs = []
    for split, size in config.splits:
        (tmp / split / "images").mkdir(parents=True)
        jobs += [(config, split, tmp / split, s, min(s + CHUNK, size)) for s in range(0, size, CHUNK)]
    collected = {split: ([], []) for split, _ in config.splits}
    # spawn, not fork: the parent may hold torch threads that a forked child would inherit mid-state. The bar ends its
    # line however the pool ends, so that an error said after it starts a line of its own.
    with (tqdm(total=sum(size for _, size in config.splits), desc="shapes world", unit="scene", disable=not progress)
          as bar, multiprocessing.get_context("spawn").Pool(workers) if workers > 1 else _Inline() as pool):
        for split, annotations, pairs in pool.imap(generate_chunk, jobs):
            collected[split][0].extend(annotations)
            collected[split][1].extend(pairs)
            bar.update(len(annotations))
    for split, (annotations, pairs) in collected.items():
        _write_json(tmp / split / "annotations.json", annotations)
        _write_json(tmp / split / "nlvr2.json", pairs)
    _write_json(tmp / "config.json", {"format": FORMAT_VERSION, **asdict(config)})


class _Inline:
    """The Pool interface, run in this process (workers=1: tests, debugging)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap(self, fn, jobs):
        return map(fn, jobs)


def load_split(split: str, config: ShapesConfig = ShapesConfig(), root: Path | None = None,
               workers: int = 2) -> ShapesSplit:
    """A split of the cached dataset, generating the dataset first if needed."""
    directory = build_shapes(config, root, workers) / split
    annotations = json.loads((directory / "annotations.json").read_text())
    nlvr2 = json.loads((directory / "nlvr2.json").read_text())
    return ShapesSplit(directory, annotations, nlvr2)


def main(argv: list[str] | None = None) -> None:
    """`python -m training.data.shapes_cache`: build a dataset and report where and how long."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=20_000)
    parser.add_argument("--val", type=int, default=2_000)
    parser.add_argument("--test", type=int, default=2_000)
    parser.add_argument("--size", type=int, default=128, help="image height and width in pixels")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--root", type=Path, default=None,
                        help="cache root (default $VLSERVE_CACHE or ~/.cache/vlserve)")
    args = parser.parse_args(argv)
    config = ShapesConfig(world=WorldConfig(seed=args.seed, height=args.size, width=args.size),
                          splits=(("train", args.train), ("val", args.val), ("test", args.test)))
    start = time.perf_counter()
    path = build_shapes(config, args.root, args.workers)
    print(f"{path} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
