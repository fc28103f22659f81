"""`vlserve analyze ...`: what trained encoders do inside (attention-head grounding)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from training.run_config import RunConfig, config_command
from vlserve.commands.checks import check_cache_root, check_writable_dir, fail

app = typer.Typer(help="Analyse trained encoders.", no_args_is_help=True)


@app.command("grounding")
@config_command(RunConfig, only=("threads",), build=False)
def grounding(
    model_dir: Annotated[Path, typer.Argument(help="encoder checkpoint directory")],
    detector_dir: Annotated[Path, typer.Option("--detector-dir", "--detector", help="detector checkpoint directory the encoder was trained on")],
    examples: Annotated[int, typer.Option(min=1, help="shapes-world grounding captions (one per scene)")] = 500,
    split: Annotated[str, typer.Option(help="shapes-world split the scenes come from")] = "val",
    out: Annotated[Path, typer.Option(help="directory for grounding.json, grounding.md and grounding.png")] = Path("grounding"),
    *,
    threads: int,  # RunConfig's option
) -> None:
    """Every attention head as a word -> region classifier (Li et al. 2020): entity grounding against the
    detector-confidence baseline, syntactic grounding per dependency relation, heads attending to the image."""
    import torch

    from training.grounding import analyze_grounding, write_report

    check_writable_dir(out, f"--out {out}")
    check_cache_root()
    torch.set_num_threads(threads)
    try:
        report = analyze_grounding(model_dir, detector_dir, examples, split)
    except ValueError as exc:  # CheckpointError is one
        fail(str(exc))
    paths = write_report(report, out)
    best = report["best_entity_head"]
    typer.echo(json.dumps({**{k: str(p) for k, p in paths.items()}, "best_entity_head": best,
                           "baseline": report["baseline"], "active_heads": report["active_heads"]}, indent=2))
