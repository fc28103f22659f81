"""TensorRT over an exported model repository, one of two ways:

* Standalone engines (`vlserve export --format tensorrt`): the repository's engines/<task>.plan, run by the
  tensorrt runtime API (models.engines.TensorrtEngine: an execution context per optimisation profile, torch CUDA
  tensors as device buffers, execute_async_v3). An engine runs only on the TensorRT version and the kind of GPU
  that built it, and only over the batch and text ranges of its profiles: start-up checks all three.
* Otherwise: fp16 engines built and cached at start-up by onnxruntime's TensorRT execution provider (the TensorRT
  libraries of an onnxruntime-gpu build) from the repository's ONNX graphs (the fp16 ones when exported with
  --fp16), one optimisation profile per graph covering the service's batch, text and region ranges; what TensorRT
  does not take falls back to CUDA.

Both need a CUDA GPU: on other machines `create` says what is missing.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from models.engines import MAX_REGIONS, Ranges, TensorrtEngine, environment, input_shapes, unavailable
from models.repository import GraphSpec, Repository, graph_feed, session

from .base import Runtime
from .onnx_runtime import TENSORRT, OnnxRuntime, choose_graph, choose_providers

if TYPE_CHECKING:
    from ..settings import Settings

__all__ = ["EngineRuntime", "TensorrtRuntime", "check_engines", "create", "profile_shapes"]


def profile_shapes(spec: GraphSpec, max_batch: int, max_text: int, max_regions: int = MAX_REGIONS) -> dict[str, str]:
    """TensorRT profile shapes (min / opt / max) of a graph's inputs, as the execution provider's options spell them."""
    shapes = input_shapes(spec, Ranges(max_batch, max_text, max_regions).axes())
    keys = ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes")
    return {key: ",".join(f"{name}:" + "x".join(map(str, s[which])) for name, s in shapes.items())
            for which, key in enumerate(keys)}


class TensorrtRuntime(OnnxRuntime):
    """onnxruntime's TensorRT execution provider, fp16, engines built at start-up and cached."""

    name = "tensorrt"
    precision = "fp16"

    def __init__(self, repository: Repository, device: str = "cuda", threads: int = 2, engine_cache_dir: Path | None = None,
                 max_batch: int = 32, max_text: int = 64) -> None:
        import onnxruntime

        available = onnxruntime.get_available_providers()
        if TENSORRT not in available or not device.startswith("cuda"):
            raise ValueError(f"runtime 'tensorrt' needs a CUDA device (VLSERVE_DEVICE=cuda, got {device!r}) and "
                             f"onnxruntime's TensorRT execution provider (onnxruntime-gpu with TensorRT); this "
                             f"onnxruntime has {', '.join(available)}")
        self.repository = repository
        self.tasks = repository.tasks
        self.graph_files, self.sessions = {}, {}
        for task, spec in repository.graphs.items():
            options = {"trt_fp16_enable": True, **profile_shapes(spec, max_batch, max_text)}
            self.providers = choose_providers(device, available, engine_cache_dir, options)
            self.graph_files[task] = choose_graph(repository, task, self.providers)
            self.sessions[task] = session(self.graph_files[task], threads, self.providers, spin=False)


def check_engines(engines: dict[str, Any], here: dict[str, str], max_batch: int, max_text: int) -> None:
    """ValueError naming the mismatch when a repository's engines (manifest "engines") cannot serve on this machine
    (`here`: models.engines.environment()) at these service limits."""
    again = "export --format tensorrt again on this machine, or serve the ONNX graphs (VLSERVE_RUNTIME=onnxruntime)"
    if engines.get("tensorrt") != here["tensorrt"]:
        raise ValueError(f"the repository's engines were built by TensorRT {engines.get('tensorrt')}, this machine has "
                         f"TensorRT {here['tensorrt']}: {again}")
    if engines.get("compute_capability") != here["compute_capability"]:
        raise ValueError(f"the repository's engines were built for a GPU of compute capability "
                         f"{engines.get('compute_capability')} ({engines.get('device')}), this is "
                         f"{here['compute_capability']} ({here['device']}): {again}")
    ranges = engines.get("ranges") or {}
    for setting, value, key, option in (("VLSERVE_MAX_BATCH_SIZE", max_batch, "max_batch", "--max-batch"),
                                        ("VLSERVE_MAX_TEXT_TOKENS", max_text, "max_text", "--max-text")):
        if value > ranges.get(key, 0):
            raise ValueError(f"{setting}={value} exceeds the engines' profiles (up to {ranges.get(key)}): lower it or "
                             f"export again with {option} {value}")


class EngineRuntime(Runtime):
    """The repository's standalone TensorRT engines, one per task, on one CUDA device."""

    name = "tensorrt"
    precision = "fp16"  # engines are built in fp16 (export/engines.py)

    def __init__(self, repository: Repository, device: str = "cuda", max_batch: int = 32, max_text: int = 64) -> None:
        reason = unavailable(device)
        if reason:
            raise ValueError(f"runtime 'tensorrt' serves this repository's TensorRT engines, but {reason}")
        check_engines(repository.engines, environment(device), max_batch, max_text)
        missing = [task for task in repository.tasks if task not in repository.engines["graphs"]]
        if missing:
            raise ValueError(f"{repository.path}: no TensorRT engine for {', '.join(missing)}")
        self.repository = repository
        self.tasks = repository.tasks
        self.engines = {task: TensorrtEngine(repository.engine_path(task), device) for task in self.tasks}

    def run(self, task: str, batch: dict[str, np.ndarray]) -> np.ndarray:
        self.check_batch(task, batch)
        return self.engines[task].run(graph_feed(self.repository.graphs[task], batch))

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()


def create(settings: Settings, checkpoint: Repository) -> Runtime:
    if not isinstance(checkpoint, Repository):
        raise ValueError("runtime 'tensorrt' serves a model repository (`vlserve export MODEL_DIR --out REPO_DIR`), "
                         "not a checkpoint directory")
    if checkpoint.engines:
        return EngineRuntime(checkpoint, device=settings.device, max_batch=settings.max_batch_size,
                             max_text=settings.max_text_tokens)
    return TensorrtRuntime(checkpoint, device=settings.device, threads=settings.threads,
                           engine_cache_dir=settings.engine_cache_dir, max_batch=settings.max_batch_size,
                           max_text=settings.max_text_tokens)
