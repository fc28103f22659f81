"""`vlserve import hf-visualbert|hf-lxmert SRC OUT`: convert transformers checkpoints into vlserve checkpoints."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Convert public checkpoints (transformers' VisualBERT, LXMERT) into vlserve checkpoint directories.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

Source = Annotated[Path, typer.Argument(help="directory written by transformers' save_pretrained (config.json + weights)")]
Out = Annotated[Path, typer.Argument(help="vlserve checkpoint directory to write")]
Force = Annotated[bool, typer.Option("--force", help="write into OUT even if it already holds files")]


def _run(convert: Callable[[Path, Path], Path], src: Path, out: Path, force: bool) -> None:
    """Run one importer; any import error becomes one line on stderr and exit code 2."""
    from models.checkpoint import CheckpointError

    if out.resolve() == src.resolve():
        typer.echo(f"error: {out}: OUT must differ from SRC", err=True)
        raise typer.Exit(2)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not force)):
        typer.echo(f"error: {out}: already exists and is not empty (pass --force to write into it)", err=True)
        raise typer.Exit(2)
    try:
        path = convert(src, out)
    except (CheckpointError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    record = json.loads((path / "manifest.json").read_text())["import"]
    ignored = record["ignored_keys"]
    if ignored:
        shown = ", ".join(ignored[:8]) + (f", ... ({len(ignored) - 8} more)" if len(ignored) > 8 else "")
        typer.echo(f"warning: {len(ignored)} source tensors not imported (listed in manifest.json): {shown}", err=True)
    heads = json.loads((path / "config.json").read_text())["heads"]
    typer.echo(f"wrote {path} ({record['architecture'] or 'unknown architecture'}; heads: {', '.join(heads) or 'none'})")


@app.command("hf-visualbert")
def hf_visualbert(src: Source, out: Out, force: Force = False) -> None:
    """Import a transformers VisualBert* checkpoint (uclanlp/visualbert-* format)."""
    from models.importers.hf_visualbert import import_visualbert

    _run(import_visualbert, src, out, force)


@app.command("hf-lxmert")
def hf_lxmert(src: Source, out: Out, force: Force = False) -> None:
    """Import a transformers Lxmert* checkpoint (unc-nlp/lxmert-* format)."""
    from models.importers.hf_lxmert import import_lxmert

    _run(import_lxmert, src, out, force)
