"""`vlserve export MODEL_DIR --out REPO_DIR`: a checkpoint directory -> an ONNX model repository (fp16 graphs and
TensorRT engines for GPUs on request), parity-checked."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from vlserve.commands.termination import unwinding


def export(
    model_dir: Annotated[Path, typer.Argument(help="checkpoint directory (config.json, model.safetensors, manifest.json)")],
    out: Annotated[Path, typer.Option(help="repository directory to create (must not exist or be empty)")],
    fmt: Annotated[str, typer.Option("--format", help="onnx, or tensorrt (also fp16 TensorRT engines; needs the tensorrt package and a CUDA GPU)")] = "onnx",
    optimize: Annotated[bool, typer.Option("--optimize", help="onnxruntime transformer fusions (attention, skip-LayerNorm, GELU)")] = False,
    quantize: Annotated[str | None, typer.Option(help="int8: dynamic quantization (per-channel weights) of MatMul/Gemm and the fused self-attention")] = None,
    fp16: Annotated[bool, typer.Option("--fp16", help="also fp16 graphs (fp32 inputs/outputs) for the CUDA and TensorRT execution providers")] = False,
    opset: Annotated[int, typer.Option(help="ONNX opset of the graphs")] = 17,  # models.repository.DEFAULT_OPSET,
    # written out: importing models (torch) here would slow every vlserve command's start by 1.4 s; a test keeps them equal
    exporter: Annotated[str, typer.Option(help="torchscript (default) or dynamo (which needs a newer --opset than the default; the error says which)")] = "torchscript",
    examples: Annotated[int, typer.Option(min=1, help="examples in the top-1 agreement check, at least 16: the four shape-checking batches (1, 3, 5 and 7 examples) always run, then batches of 32 up to this number")] = 1000,
    max_abs_diff: Annotated[float, typer.Option(help="fail past this max abs fp32 logit difference to torch (finite, above 0)")] = 1e-4,
    min_agreement: Annotated[float, typer.Option(help="fail below this top-1 agreement with torch (fp32; a share from 0 to 1)")] = 0.995,
    int8_min_agreement: Annotated[float, typer.Option(help="fail below this top-1 agreement with torch (int8)")] = 0.5,
    fp16_max_abs_diff: Annotated[float, typer.Option(help="fail past this max abs logit difference to torch (fp16 graphs, engines)")] = 5e-2,
    fp16_min_agreement: Annotated[float, typer.Option(help="fail below this top-1 agreement with torch (fp16 graphs, engines)")] = 0.99,
    max_batch: Annotated[int, typer.Option(min=1, help="TensorRT engines: largest batch (VLSERVE_MAX_BATCH_SIZE)")] = 32,
    max_text: Annotated[int, typer.Option(min=1, help="TensorRT engines: longest text in tokens (VLSERVE_MAX_TEXT_TOKENS)")] = 64,
    max_regions: Annotated[int, typer.Option(min=1, help="TensorRT engines: most regions per image")] = 100,
    threads: Annotated[int, typer.Option(min=1, help="torch and onnxruntime threads")] = 2,
    detector: Annotated[Path | None, typer.Option(help="detector directory the checkpoint expects: exported too")] = None,
) -> None:
    """Export every task head of a checkpoint to ONNX (one graph per task) with a manifest and a parity report;
    with --fp16 also fp16 graphs, with --format tensorrt also fp16 TensorRT engines built on this GPU.

    Exit code 0 with the repository written; 1 when a graph misses the parity bounds (nothing is written);
    2 when the checkpoint or the options are not usable, or another export is writing --out. SIGTERM, as Ctrl-C,
    removes what was started and ends the process by that signal (exit status 143 in a shell).
    """
    from models.checkpoint import CheckpointError
    from export.engines import Ranges
    from export.repository import ExportError, ParityError, export_repository

    try:
        repo = unwinding(  # SIGTERM, as Ctrl-C, removes the temporary repository on the way out
                export_repository,
                model_dir, out, fmt=fmt, optimize=optimize, quantize=quantize, fp16=fp16, opset=opset, exporter=exporter,
                examples=examples, threads=threads, max_abs_diff=max_abs_diff, min_agreement=min_agreement,
                int8_min_agreement=int8_min_agreement, fp16_max_abs_diff=fp16_max_abs_diff,
                fp16_min_agreement=fp16_min_agreement, engine_ranges=Ranges(max_batch, max_text, max_regions),
                detector_dir=detector, log=lambda m: typer.echo(m, err=True))
    except ExportError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1 if isinstance(exc, ParityError) else 2) from None
    except (CheckpointError, OSError, ValueError) as exc:  # OSError: --out or the disk, not the graphs' parity
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    summary = {task: {k: v for k, v in p.items() if isinstance(v, dict) and "max_abs_diff" in v}
               for task, p in repo.parity["graphs"].items()}
    typer.echo(json.dumps({"out": str(out), "graphs": list(repo.graphs), "precision": repo.manifest["precision"],
                           "optimized": repo.manifest["optimized"], "fp16": repo.manifest.get("fp16", False),
                           "engines": list(repo.engines.get("graphs", {})),
                           "parity": {t: {k: {"max_abs_diff": v["max_abs_diff"], "agreement": v["agreement"]}
                                          for k, v in s.items()} for t, s in summary.items()},
                           "engines_parity": {t: {"max_abs_diff": v["max_abs_diff"], "agreement": v["agreement"]}
                                              for t, v in (repo.parity.get("engines") or {}).items()},
                           "detector": repo.parity.get("detector")}))
