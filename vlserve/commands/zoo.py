"""`vlserve zoo build`: build a model set (detector + multi-task encoder + model card) into the cache."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from training.run_config import RunConfig, config_command
from vlserve.commands.checks import check_cache_root, check_writable_dir, fail, os_error
from vlserve.commands.termination import unwinding

app = typer.Typer(help="Build the model sets the service runs on.", no_args_is_help=True)

# Minutes a build of each model set takes into an empty cache on 2 cores with native bfloat16 (AMD EPYC, AVX512-BF16),
# as docs/RESULTS.md measures them and README.md and docs/TRAINING.md repeat: the figures of `vlserve zoo build --help`
# and `vlserve serve --help`
BUILD_MINUTES = {"demo": 9.3, "pretrained": 13.7, "full": 27.6}
PROFILE_HELP = (f"demo ({BUILD_MINUTES['demo']} min), pretrained (the demo after grounded pretraining, "
                f"{BUILD_MINUTES['pretrained']} min) or full (the demo's recipe on all the data, {BUILD_MINUTES['full']} "
                "min); the minutes of a build on 2 cores with native bfloat16 (docs/RESULTS.md)")


@app.command("build")
@config_command(RunConfig, only=("threads", "device"), build=False)
def build(
    profile: Annotated[str, typer.Option(help=PROFILE_HELP)] = "demo",
    root: Annotated[Path | None, typer.Option(help="cache root of everything the build writes: shapes-world data, "
                                              "region features, the model set (default $VLSERVE_CACHE or "
                                              "~/.cache/vlserve)")] = None,
    force: Annotated[bool, typer.Option(help="rebuild even if it exists")] = False,
    *,
    threads: int,  # RunConfig's options
    device: str,
) -> None:
    """Train the detector, extract regions once, fine-tune the encoder and write MODEL_CARD.md."""
    from training.device import resolve_device
    from training.finetune import TrainingError
    from training.pretrain import PretrainConfigError
    from training.zoo import PROFILES, build_zoo, is_built, zoo_dir

    if profile not in PROFILES:
        fail(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    try:
        resolve_device(device)
    except ValueError as exc:
        fail(str(exc))
    check_cache_root(root)
    if root is not None:  # data and feature caches read the cache root from the environment
        os.environ["VLSERVE_CACHE"] = str(root)
    model_set = zoo_dir(profile, root)
    if force or not is_built(model_set):  # a writable cache root may hold a read-only zoo/
        check_writable_dir(model_set, f"model set {model_set}")
    try:
        # SIGTERM (docker stop, a pod's end) unwinds as Ctrl-C does: half-written scenes are removed, not left
        path = unwinding(build_zoo, profile, root, force=force, threads=threads, device=device)
    except (TrainingError, PretrainConfigError) as exc:  # diverged, or a train_state.pt of another recipe's run
        fail(str(exc))
    except OSError as exc:  # the cache's disk full, say (the writability check passes on a full disk)
        fail(f"cannot build the {profile} model set into {model_set}: {os_error(exc)}")
    typer.echo(str(path))
