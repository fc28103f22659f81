"""`vlserve train ...`: training commands (the detector now; pretraining and fine-tuning with issue 4)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

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
) -> None:
    """Fine-tune the EfficientNet-Lite0 Faster R-CNN region detector on shapes-world scenes."""
    from training.data.shapes_cache import ShapesConfig
    from training.detector_train import DetectorTrainConfig, train_detector

    data = ShapesConfig(splits=(("train", train_scenes), ("val", val_scenes), ("test", test_scenes)))
    cfg = DetectorTrainConfig(out=out, steps=steps, batch_size=batch_size, lr=lr, eval_every=eval_every, seed=seed,
                              data=data, detector={"feature_dim": feature_dim, "num_boxes": num_boxes})
    metrics = train_detector(cfg)
    typer.echo(json.dumps({"out": str(out), "val": metrics["val"], "train_seconds": metrics["train_seconds"],
                           "fingerprint": metrics["fingerprint"]}, indent=2))
