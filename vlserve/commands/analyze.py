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
    examples: Annotated[int, typer.Option(min=1, help="shapes-world grounding captions (one per scene, at most the "
                                                     "split's scenes)")] = 500,
    split: Annotated[str, typer.Option(help="shapes-world split the scenes come from")] = "val",
    out: Annotated[Path, typer.Option(help="directory for grounding.json, grounding.md and grounding.png")] = Path("grounding"),
    *,
    threads: int,  # RunConfig's option
) -> None:
    """Every attention head as a word -> region classifier (Li et al. 2020): entity grounding against the
    detector-confidence baseline, syntactic grounding per dependency relation, heads attending to the image."""
    import torch

    from training.grounding import analyze_grounding, report_paths, split_scenes, write_report

    try:
        scenes = split_scenes(split)
    except ValueError as exc:
        fail(str(exc))
    if examples > scenes:
        fail(f"--examples {examples}: the {split} split has {scenes} scenes, one grounding caption at most each")
    check_writable_dir(out, f"--out {out}")
    for path in report_paths(out).values():  # the report is renamed over these: not after the whole analysis
        if path.is_dir():
            fail(f"--out {out}: {path} is a directory; the report writes a file there")
    check_cache_root()
    torch.set_num_threads(threads)
    try:
        report = analyze_grounding(model_dir, detector_dir, examples, split)
    except ValueError as exc:  # CheckpointError is one
        fail(str(exc))
    try:
        paths = write_report(report, out)
    except OSError as exc:
        fail(f"--out {out}: cannot write the report ({exc})")
    best = report["best_entity_head"]
    typer.echo(json.dumps({**{k: str(p) for k, p in paths.items()}, "best_entity_head": best,
                           "baseline": report["baseline"], "active_heads": report["active_heads"]}, indent=2))
