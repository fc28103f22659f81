"""`vlserve eval ...`: measure checkpoints on held-out data."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Evaluate detectors and encoders.", no_args_is_help=True)


@app.command("detector")
def detector(
    path: Annotated[Path, typer.Argument(help="detector checkpoint directory")],
    scenes: Annotated[int, typer.Option(min=1, help="shapes-world test scenes")] = 2_000,
    easy_vqa_images: Annotated[int, typer.Option(min=0, help="easy-VQA test images (0 = skip)")] = 1_000,
    threads: Annotated[int, typer.Option(min=1)] = 2,
) -> None:
    """mAP@0.5 on the shapes-world test split and single-shape recall on easy-VQA test images."""
    import torch

    from models.checkpoint import CheckpointError
    from models.detector.io import load_detector
    from training.data.easy_vqa import load_easy_vqa
    from training.data.shapes_cache import load_split
    from training.detector_eval import easy_vqa_shape_recall, evaluate_map

    torch.set_num_threads(threads)
    try:
        det, fingerprint = load_detector(path)
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    test = load_split("test")
    result = {"detector": fingerprint, "shapes_test": evaluate_map(det, test, range(min(scenes, len(test))))}
    if easy_vqa_images:
        paths = [p for _, p in sorted(load_easy_vqa("test").image_paths.items())][:easy_vqa_images]
        result["easy_vqa_test"] = easy_vqa_shape_recall(det, paths)
    typer.echo(json.dumps(result, indent=2))
