"""TensorRT over an exported model repository: fp16 engines built from its ONNX graphs, one optimisation profile
per graph covering the service's batch, text and region ranges.

The engines are built and cached by onnxruntime's TensorRT execution provider (the TensorRT libraries of an
onnxruntime-gpu build); what TensorRT does not take falls back to CUDA. It needs a CUDA GPU: on other machines
`create` says what is missing.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from export.encoder import GraphSpec
from export.repository import Repository, session

from .onnx_runtime import TENSORRT, OnnxRuntime, choose_providers

if TYPE_CHECKING:
    from ..settings import Settings

__all__ = ["TensorrtRuntime", "create", "profile_shapes"]

MAX_REGIONS = 100  # bottom-up attention's adaptive mode keeps at most 100 regions
MAX_CHOICES, MAX_PHRASES = 8, 16  # multiple choice candidates, grounding phrases


def profile_shapes(spec: GraphSpec, max_batch: int, max_text: int, max_regions: int = MAX_REGIONS) -> dict[str, str]:
    """TensorRT profile shapes (min / opt / max) of a graph's inputs, as the execution provider's options spell them."""
    ranges = {"batch": (1, max(1, max_batch // 2), max_batch), "text": (1, min(16, max_text), max_text),
              "regions": (1, min(36, max_regions), max_regions), "choices": (1, 4, MAX_CHOICES),
              "phrases": (1, 4, MAX_PHRASES)}
    out = {}
    for key, which in (("trt_profile_min_shapes", 0), ("trt_profile_opt_shapes", 1), ("trt_profile_max_shapes", 2)):
        out[key] = ",".join(
            f"{inp.name}:" + "x".join(str(ranges[d][which] if isinstance(d, str) else d) for d in inp.shape)
            for inp in spec.inputs)
    return out


class TensorrtRuntime(OnnxRuntime):
    name = "tensorrt"

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
        self.sessions = {}
        for task, spec in repository.graphs.items():
            options = {"trt_fp16_enable": True, **profile_shapes(spec, max_batch, max_text)}
            self.providers = choose_providers(device, available, engine_cache_dir, options)
            self.sessions[task] = session(repository.graph_path(task), threads, self.providers, spin=False)


def create(settings: Settings, checkpoint: Repository) -> TensorrtRuntime:
    if not isinstance(checkpoint, Repository):
        raise ValueError("runtime 'tensorrt' serves a model repository (`vlserve export MODEL_DIR --out REPO_DIR`), "
                         "not a checkpoint directory")
    return TensorrtRuntime(checkpoint, device=settings.device, threads=settings.threads,
                           engine_cache_dir=settings.engine_cache_dir, max_batch=settings.max_batch_size,
                           max_text=settings.max_text_tokens)
