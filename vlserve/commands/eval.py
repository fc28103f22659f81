"""`vlserve eval ...`: measure checkpoints on held-out data."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from training.run_config import RunConfig, config_command
from vlserve.commands.checks import check_cache_root, fail

app = typer.Typer(help="Evaluate detectors and encoders.", no_args_is_help=True)


@app.command("detector")
@config_command(RunConfig, only=("threads",), build=False)
def detector(
    path: Annotated[Path, typer.Argument(help="detector checkpoint directory")],
    scenes: Annotated[int, typer.Option(min=1, help="shapes-world test scenes")] = 2_000,
    easy_vqa_images: Annotated[int, typer.Option(min=0, help="easy-VQA test images (0 = skip)")] = 1_000,
    *,
    threads: int,  # RunConfig's option
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
        fail(str(exc))
    check_cache_root()
    test = load_split("test")
    result = {"detector": fingerprint, "shapes_test": evaluate_map(det, test, range(min(scenes, len(test))))}
    if easy_vqa_images:
        paths = [p for _, p in sorted(load_easy_vqa("test").image_paths.items())][:easy_vqa_images]
        result["easy_vqa_test"] = easy_vqa_shape_recall(det, paths)
    typer.echo(json.dumps(result, indent=2))


@app.command("encoder")
@config_command(RunConfig, only=("threads", "device"), build=False)
def encoder(
    path: Annotated[Path, typer.Argument(help="encoder checkpoint directory (fine-tuned or pretraining)")],
    detector_dir: Annotated[Path, typer.Option(help="detector checkpoint directory the encoder was trained with")],
    split: Annotated[str, typer.Option(help="shapes-world split: val or test")] = "test",
    scenes: Annotated[int, typer.Option(min=1, help="shapes-world scenes whose task examples are evaluated")] = 1_000,
    easy_vqa_images: Annotated[int, typer.Option(min=0, help="easy-VQA test images (0 = skip)")] = 1_000,
    retrieval_pool: Annotated[int, typer.Option(min=0, help="retrieval pool: the split's first scenes, one caption each (0 = skip)")] = 1_000,
    retrieval_queries: Annotated[int, typer.Option(min=1, help="queries per direction, each ranks the whole pool")] = 100,
    retrieval_directions: Annotated[str, typer.Option(
        help="both, text-to-image or image-to-text: one direction scores half the pairs")] = "both",
    shapes_dir: Annotated[Path | None, typer.Option(help="a built shapes-world dataset directory (default: the standard one)")] = None,
    precision: Annotated[str, typer.Option(help="fp32, or bf16: bfloat16 GEMMs as the service serves by default where "
                                                "the CPU has native bfloat16 (as the model card's metrics; about 2x faster), "
                                                "bfloat16 autocast on a GPU")] = "fp32",
    *,
    threads: int,  # RunConfig's options
    device: str,
) -> None:
    """Every metric the checkpoint's heads support, as JSON: vqa/refer/itm/nlvr2/mc/easy_vqa accuracy and
    retrieval R@1/5/10 both ways (zero-shot from a pretraining checkpoint's ITM head)."""
    import time

    import torch

    from models.checkpoint import CheckpointError, load_checkpoint
    from models.detector.io import load_detector
    from models.query_bank import QueryBank
    from models.layers import bf16_unavailable
    from training.evaluate import evaluate_tasks, head_for
    from training.device import resolve_device
    from training.finetune import gemm_precision
    from training.retrieval import DIRECTIONS, evaluate_retrieval
    from training.data.shapes_cache import ShapesConfig, load_split
    from training.vl_data import prepare_eval_data, shapes_config_from_dir, tagged

    if split not in ("val", "test"):
        fail(f"--split must be val or test, got {split!r}")
    if precision not in ("fp32", "bf16"):
        fail(f"--precision must be fp32 or bf16, got {precision!r}")
    try:
        where = resolve_device(device)
    except ValueError as exc:
        fail(str(exc))
    unavailable = bf16_unavailable(where)
    if precision == "bf16" and unavailable is not None:
        fail(f"--precision bf16: {unavailable}")
    directions = {"both": DIRECTIONS, "text-to-image": ("text_to_image",), "image-to-text": ("image_to_text",)}
    if retrieval_directions not in directions:
        fail(f"--retrieval-directions must be one of {', '.join(directions)}, got {retrieval_directions!r}")
    if retrieval_pool == 1:
        fail("--retrieval-pool must be 0 (no retrieval) or at least 2: over a pool of one image R@1 is 1.0 by itself")
    torch.set_num_threads(threads)
    started = time.perf_counter()
    try:
        checkpoint = load_checkpoint(path)
        detector, fingerprint = load_detector(detector_dir)
    except CheckpointError as exc:
        fail(str(exc))
    enc, expected = checkpoint.model.config.encoder, checkpoint.manifest.get("detector") or {}
    if expected.get("fingerprint") not in (None, fingerprint):
        fail(f"{path} was trained on regions of detector {expected['fingerprint']}, but {detector_dir} is {fingerprint}")
    if enc.visual_feat_dim != detector.config.feature_dim:
        fail(f"{path} reads {enc.visual_feat_dim}-d region features, but {detector_dir} produces {detector.config.feature_dim}-d")
    check_cache_root()
    shapes = {}
    if shapes_dir is not None:
        try:
            shapes["data"], shapes["shapes_root"] = shapes_config_from_dir(shapes_dir)
        except ValueError as exc:
            fail(str(exc))
    model, tokenizer = checkpoint.model, checkpoint.tokenizer
    if tokenizer.max_length > enc.text_positions:  # an imported checkpoint may place fewer: rows would index past
        # its position table (the service cuts its texts the same way: app.text_token_limit)
        typer.echo(f"note: texts are cut to the {enc.text_positions} text positions of {path} (its tokenizer's "
                   f"max_length is {tokenizer.max_length})", err=True)
        tokenizer.max_length = enc.text_positions
    easy_vqa_images = easy_vqa_images if head_for(model, "vqa") else 0  # extract only what some head reads
    retrieval_pool = retrieval_pool if head_for(model, "itm") else 0
    data = tagged(prepare_eval_data(detector_dir, split, scenes, easy_vqa_images, retrieval_pool, **shapes, device=device), model, tokenizer)
    scenes = min(scenes, len(load_split(split, shapes.get("data", ShapesConfig()), shapes.get("shapes_root"))))  # scored
    model.to(where)
    with gemm_precision(model, precision):
        result = {"encoder": str(path), "preset": enc.preset, "size": enc.size, "heads": model.tasks,
                  "detector": fingerprint, "split": split, "scenes": scenes, "precision": precision, "device": str(where),
                  **evaluate_tasks(model, data, tokenizer, head_answers=checkpoint.labels.get("heads"))}
        if retrieval_pool:
            retrieval_started = time.perf_counter()
            result["retrieval"] = evaluate_retrieval(model, data, tokenizer, retrieval_queries,
                                                     directions=directions[retrieval_directions],
                                                     bank=QueryBank.from_labels(checkpoint.labels))
            result["retrieval"]["seconds"] = round(time.perf_counter() - retrieval_started, 1)
    result["seconds"] = round(time.perf_counter() - started, 1)
    typer.echo(json.dumps(result, indent=2))
