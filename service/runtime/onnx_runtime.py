"""onnxruntime over an exported model repository: one InferenceSession per task graph.

Execution providers: CPU for device "cpu"; for "cuda[:N]" TensorRT (engines cached in a directory) then CUDA,
whichever of them this onnxruntime build has (onnxruntime.get_available_providers()), CPU last for the
operators they do not take. Graphs: a task's fp16 graph (`vlserve export --fp16`) where a CUDA or TensorRT
provider runs it, its fp32 (or int8) graph otherwise.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from models.detector.onnx import OnnxDetector
from models.repository import Repository, graph_feed, open_graph

from .base import Runtime

if TYPE_CHECKING:
    from ..settings import Settings

__all__ = ["OnnxRuntime", "choose_graph", "choose_providers", "create", "exported_detector"]

TENSORRT, CUDA, CPU = "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"
GPU_PROVIDERS = (TENSORRT, CUDA)  # providers that run fp16 arithmetic natively (CPU would cast most of it back)


def default_engine_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlserve" / "tensorrt"


def choose_providers(device: str, available: list[str], engine_cache_dir: Path | None = None,
                     tensorrt_options: dict[str, Any] | None = None) -> list[Any]:
    """onnxruntime providers (with options) for `device`, from the ones this build has."""
    if device == "cpu":
        return [CPU]
    device_id = int(device.partition(":")[2] or 0)
    chosen: list[Any] = []
    if TENSORRT in available:
        cache = Path(engine_cache_dir or default_engine_cache())
        cache.mkdir(parents=True, exist_ok=True)
        chosen.append((TENSORRT, {"device_id": device_id, "trt_engine_cache_enable": True,
                                  "trt_engine_cache_path": str(cache), "trt_timing_cache_enable": True,
                                  "trt_timing_cache_path": str(cache), **(tensorrt_options or {})}))
    if CUDA in available:
        chosen.append((CUDA, {"device_id": device_id}))
    if not chosen:
        raise ValueError(f"device {device!r} needs onnxruntime's TensorRT or CUDA execution provider, but this "
                         f"onnxruntime has only {', '.join(available)} (install onnxruntime-gpu)")
    return [*chosen, CPU]


def choose_graph(repository: Repository, task: str, providers: list[Any]) -> Path:
    """`task`'s fp16 graph when a CUDA or TensorRT provider is among `providers` and the repository has one;
    its CPU graph (fp32 or int8) otherwise."""
    names = {p[0] if isinstance(p, tuple) else p for p in providers}
    return repository.graph_path(task, fp16=bool(names & set(GPU_PROVIDERS)) and repository.has_fp16(task))


class OnnxRuntime(Runtime):
    name = "onnxruntime"

    def __init__(self, repository: Repository, device: str = "cpu", threads: int = 2,
                 engine_cache_dir: Path | None = None) -> None:
        import onnxruntime

        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.repository = repository
        self.providers = choose_providers(device, onnxruntime.get_available_providers(), engine_cache_dir)
        self.tasks = repository.tasks
        self.graph_files = {task: choose_graph(repository, task, self.providers) for task in self.tasks}
        fp16 = any(path.name.endswith(".fp16.onnx") for path in self.graph_files.values())
        self.precision = "fp16" if fp16 else str(repository.manifest.get("precision", "fp32"))
        # no spinning: the detector's session and the encoder's run side by side on the same cores; a graph
        # onnxruntime refuses is one RepositoryError naming it (the service's start-up error)
        self.sessions = {task: open_graph(path, threads, self.providers, spin=False)
                         for task, path in self.graph_files.items()}

    def run(self, task: str, batch: dict[str, np.ndarray]) -> np.ndarray:
        self.check_batch(task, batch)
        (logits,) = self.sessions[task].run(None, graph_feed(self.repository.graphs[task], batch))
        return logits

    def close(self) -> None:
        self.sessions.clear()


def create(settings: Settings, checkpoint: Repository) -> OnnxRuntime:
    if not isinstance(checkpoint, Repository):
        raise ValueError("runtime 'onnxruntime' serves a model repository (`vlserve export MODEL_DIR --out REPO_DIR`), "
                         "not a checkpoint directory")
    return OnnxRuntime(checkpoint, device=settings.device, threads=settings.threads,
                       engine_cache_dir=settings.engine_cache_dir)


def exported_detector(repository: Repository, config, settings: Settings) -> OnnxDetector:
    """The repository's detector graph on the providers of `settings.device` (same regions as the torch detector);
    RepositoryError when onnxruntime refuses the graph."""
    import onnxruntime

    providers = choose_providers(settings.device, onnxruntime.get_available_providers(), settings.engine_cache_dir)
    return OnnxDetector(open_graph(repository.detector_path, settings.threads, providers, spin=False), config)
