"""`vlserve info DIR`: verify a checkpoint, detector or model repository directory and print what it holds."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

CHECKPOINT = "checkpoint"  # the kind of a manifest that names none (save_checkpoint writes none)


def manifest_kind(path: Path) -> str | None:
    """The manifest's "kind" (CHECKPOINT when it names none), read without verifying anything; None when the
    manifest cannot be read, so that the kind's loader reports why."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return str(manifest.get("kind", CHECKPOINT)) if isinstance(manifest, dict) else None


def checkpoint_summary(path: Path) -> dict:
    from models.checkpoint import load_checkpoint

    ckpt = load_checkpoint(path)
    enc = ckpt.model.config.encoder
    return {
        "path": str(path),
        "kind": CHECKPOINT,
        "preset": enc.preset,
        "size": enc.size,
        "hidden_size": enc.hidden_size,
        "visual_feat_dim": enc.visual_feat_dim,
        "parameters": sum(p.numel() for p in ckpt.model.parameters()),
        "heads": {name: h.kind for name, h in ckpt.model.config.heads.items()},
        "detector": ckpt.manifest.get("detector", {}),
        "verified_files": sorted(ckpt.manifest["files"]),
    }


def detector_summary(path: Path) -> dict:
    from models.detector.io import KIND, load_detector

    detector, fingerprint = load_detector(path)
    cfg = detector.config
    files = json.loads((path / "manifest.json").read_text())["files"]  # verified by load_detector
    return {
        "path": str(path),
        "kind": KIND,
        "fingerprint": fingerprint,
        "family": cfg.family,
        "backbone": cfg.backbone,
        "classes": len(cfg.classes),
        "attributes": len(cfg.attributes),
        "feature_dim": cfg.feature_dim,
        "regions": f"{cfg.min_boxes}-{cfg.max_boxes}" if cfg.adaptive else cfg.num_boxes,
        "parameters": sum(p.numel() for p in detector.parameters()),
        "verified_files": sorted(files),
    }


PARSED = ("parsed by onnx, holds a graph with inputs and outputs, IR version and opset within what this onnxruntime "
          "loads")
GRAPH_CHECK = (f"{PARSED}; onnxruntime sessions are created when the service starts (`vlserve info --sessions` "
               "creates them here)")
SESSION_CHECK = (f"{PARSED}; the graphs served on CPU (each task's graph, the detector's) loaded in onnxruntime CPU "
                 "sessions as the service loads them")
FP16_UNOPENED = "; fp16 graphs, served by the CUDA and TensorRT providers only, not loaded"


def repository_summary(path: Path, sessions: bool = False) -> dict:
    """The repository's summary; every graph checked with check_graph, and with `sessions` each graph the service
    opens on CPU loaded in an onnxruntime session too (seconds for a large encoder)."""
    from models.repository import KIND, check_graph, detector_graph, graph_files, load_repository, open_graph

    repo = load_repository(path)
    manifest, enc = repo.manifest, repo.config.encoder
    graphs = graph_files(manifest["graphs"], {})  # engines are TensorRT's, not ONNX graphs
    for name in [*graphs, *detector_graph(manifest, path)]:
        check_graph(path / name)
    graph_check = GRAPH_CHECK
    if sessions:
        served = [repo.graph_path(task) for task in repo.graphs]  # what service.runtime.onnx_runtime opens on CPU
        for graph in served + ([repo.detector_path] if repo.detector_path else []):
            open_graph(graph, threads=1, spin=False)
        graph_check = SESSION_CHECK + (FP16_UNOPENED if any(repo.has_fp16(task) for task in repo.graphs) else "")
    return {
        "path": str(path),
        "kind": KIND,
        "format": manifest.get("format"),
        "preset": enc.preset,
        "size": enc.size,
        "visual_feat_dim": enc.visual_feat_dim,
        "opset": manifest["opset"],
        "precision": manifest.get("precision"),
        "optimized": manifest.get("optimized", False),
        "graphs": {task: {"kind": spec.kind, "file": manifest["graphs"][task]["file"],
                          "fp16": repo.has_fp16(task)} for task, spec in repo.graphs.items()},
        "engines": sorted(repo.engines.get("graphs", {})),
        "detector": manifest.get("detector", {}),
        "verified_files": sorted(manifest["files"]),
        "graph_check": graph_check,
    }


def info(path: Annotated[Path, typer.Argument(
        help="checkpoint directory (vlserve import, train), detector directory (vlserve import frcnn-vg) or model "
             "repository (vlserve export)")],
         sessions: Annotated[bool, typer.Option(
             "--sessions", help="model repository: also load each graph the service opens on CPU in an onnxruntime "
                                "session, as its start-up does (seconds per large graph)")] = False) -> None:
    """Verify a checkpoint, detector or model repository directory (manifest hashes, config, weights or graph
    entries) and print its summary; the summary of a repository says in `graph_check` how far its graphs were
    checked."""
    from models.checkpoint import CheckpointError
    from models.detector.io import KIND as DETECTOR
    from models.repository import KIND as REPOSITORY

    summaries = {CHECKPOINT: checkpoint_summary, DETECTOR: detector_summary, REPOSITORY: repository_summary}
    kind = manifest_kind(path)
    try:
        if kind is not None and kind not in summaries:
            raise CheckpointError(f"{path / 'manifest.json'}: kind {kind!r} is not one `vlserve info` reads "
                                  f"(a checkpoint, {DETECTOR} or {REPOSITORY} directory)")
        summary = (repository_summary(path, sessions) if kind == REPOSITORY else summaries[kind or CHECKPOINT](path))
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(summary, indent=2))
