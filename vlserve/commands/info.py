"""`vlserve info DIR`: verify a checkpoint directory and print what it holds."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def info(path: Annotated[Path, typer.Argument(help="checkpoint directory")]) -> None:
    """Verify a checkpoint directory (manifest hashes, config, weights) and print its summary."""
    from models.checkpoint import CheckpointError, load_checkpoint

    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    enc = ckpt.model.config.encoder
    params = sum(p.numel() for p in ckpt.model.parameters())
    summary = {
        "path": str(path),
        "preset": enc.preset,
        "size": enc.size,
        "hidden_size": enc.hidden_size,
        "visual_feat_dim": enc.visual_feat_dim,
        "parameters": params,
        "heads": {name: h.kind for name, h in ckpt.model.config.heads.items()},
        "detector": ckpt.manifest.get("detector", {}),
        "verified_files": sorted(ckpt.manifest["files"]),
    }
    typer.echo(json.dumps(summary, indent=2))
