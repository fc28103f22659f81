"""`vlserve extract IMAGES... --detector DIR --out PATH`: region features for folders of images."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from training.run_config import MAX_THREADS


def extract(
    images: Annotated[list[Path], typer.Argument(help="image files and/or folders (searched recursively)")],
    detector: Annotated[Path, typer.Option(help="detector checkpoint directory")],
    out: Annotated[Path, typer.Option(help="output file; an existing one is resumed")],
    fmt: Annotated[str, typer.Option("--format", help="vlfeat (our record file, which names its detector and refuses "
                                                    "resuming with another) or tsv (LXMERT obj36 TSV; it names no "
                                                    "detector: resume a TSV only with the one that began it)")] = "vlfeat",
    batch_size: Annotated[int, typer.Option(min=1, help="images per detector batch")] = 8,
    ids: Annotated[str, typer.Option(help="image ids: stem (file name) or sha256 (of the bytes, as the service)")] = "stem",
    threads: Annotated[int, typer.Option(min=1, max=MAX_THREADS, help="torch threads")] = 2,
) -> None:
    """Extract region features (boxes, features, classes, attributes) for every image; bad files are reported and skipped.

    With --ids sha256, files of the same bytes (copies, links) get one record, the others are listed as duplicates.
    Exit code 0 when every image was extracted, 1 when some could not be read (listed on stderr), 2 on usage errors.
    """
    import torch

    from models.checkpoint import CheckpointError
    from models.detector.extract import extract_folder
    from models.detector.io import load_detector
    from models.region_features import FeatureFormatError

    if fmt not in ("vlfeat", "tsv") or ids not in ("stem", "sha256"):
        typer.echo("error: --format must be vlfeat or tsv and --ids stem or sha256", err=True)
        raise typer.Exit(2)
    if out.is_dir():  # before the detector loads: --out names the feature file itself
        typer.echo(f"error: {out}: is a directory; --out takes the feature file to write or resume", err=True)
        raise typer.Exit(2)
    torch.set_num_threads(threads)
    try:
        det, fingerprint = load_detector(detector)
        report = extract_folder(det, fingerprint, images, out, fmt=fmt, batch_size=batch_size, ids=ids)
    except (CheckpointError, FeatureFormatError, OSError, ValueError) as exc:  # OSError: the output file, the disk
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for path, reason in report.failed:
        typer.echo(f"skipped {path}: {reason}", err=True)
    for path, first in report.duplicates:
        typer.echo(f"duplicate {path}: the same bytes as {first}, whose record it shares", err=True)
    typer.echo(json.dumps({"out": str(out), "written": report.written, "already_done": report.already_done,
                           "duplicates": len(report.duplicates), "failed": len(report.failed),
                           "detector": fingerprint}))
    if report.failed:
        raise typer.Exit(1)
