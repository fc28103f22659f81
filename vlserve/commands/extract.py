"""`vlserve extract IMAGES... --detector DIR --out PATH`: region features for folders of images."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from training.run_config import MAX_THREADS
from vlserve.commands.checks import disk_full, printable


def extract(
    images: Annotated[list[Path], typer.Argument(help="image files and/or folders (searched recursively)")],
    detector: Annotated[Path, typer.Option(help="detector checkpoint directory")],
    out: Annotated[Path, typer.Option(help="output file; an existing one is resumed")],
    fmt: Annotated[str, typer.Option("--format", help="vlfeat (our record file, which names its detector and id "
                                                    "scheme and refuses resuming with others) or tsv (LXMERT obj36 "
                                                    "TSV; it names no detector: resume a TSV only with the one that "
                                                    "began it)")] = "vlfeat",
    batch_size: Annotated[int, typer.Option(min=1, help="images per detector batch")] = 8,
    ids: Annotated[str, typer.Option(help="image ids: stem (file name; OUT.sources keeps each one's sha256) or sha256 "
                                          "(of the bytes, as the service)")] = "stem",
    threads: Annotated[int, typer.Option(min=1, max=MAX_THREADS, help="torch threads")] = 2,
) -> None:
    """Extract region features (boxes, features, classes, attributes) for every image; bad files are reported and skipped.

    Files of the same bytes and id (copies, links) get one record, the others are listed as duplicates.
    One run at a time writes an output; a resume checks what it holds and extracts again records that fail their CRC.
    Exit code 0: all extracted; 1: some skipped, or corrupt records left (listed on stderr); 2: usage, refused output.
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
        say(f"error: {out}: is a directory; --out takes the feature file to write or resume")
        raise typer.Exit(2)
    torch.set_num_threads(threads)
    try:
        det, fingerprint = load_detector(detector)
        report = extract_folder(det, fingerprint, images, out, fmt=fmt, batch_size=batch_size, ids=ids)
    except (CheckpointError, FeatureFormatError, OSError, ValueError) as exc:  # OSError: the output file (another
        # run writing it among them), the disk
        full = disk_full(exc) and exc.filename is None
        say(f"error: {out}: cannot write the features ({exc.strerror}); the records written are kept: run again "
            "to resume" if full else f"error: {exc}")
        raise typer.Exit(2) from None
    for path, reason in report.failed:
        say(f"skipped {path}: {reason}")
    for path, first in report.duplicates:
        say(f"duplicate {path}: the same bytes as {first}, whose record it shares")
    for image_id in report.redone:
        say(f"redone {image_id!r}: its record in {out} failed its CRC check; written again")
    for image_id in report.corrupt:
        say(f"corrupt {image_id!r}: its record in {out} fails its CRC check and this run did not write it again; "
            "extract its image again")
    typer.echo(json.dumps({"out": str(out), "written": report.written, "already_done": report.already_done,
                           "duplicates": len(report.duplicates), "failed": len(report.failed),
                           "corrupt": len(report.redone) + len(report.corrupt), "detector": fingerprint}))
    if report.failed or report.corrupt:
        raise typer.Exit(1)


def say(line: str) -> None:
    typer.echo(printable(line), err=True)
