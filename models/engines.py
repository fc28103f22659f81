"""Running a model repository's standalone TensorRT engines (engines/<task>.plan; export/engines.py builds them).

`TensorrtEngine` deserializes one engine on one CUDA device, keeps an execution context per optimisation profile,
and runs numpy batches through torch CUDA tensors (device buffers) and execute_async_v3 on its own stream. An
engine runs only on the TensorRT version and kind of GPU that built it (`environment()`), over the shapes of its
profiles (`Ranges`, `input_shapes`, `choose_profile`: pure shape logic).

Everything that touches TensorRT or CUDA needs the `tensorrt` package (the `gpu` extra) and an NVIDIA GPU;
`unavailable()` says why not on other machines.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from .repository import GraphSpec

MAX_REGIONS = 100  # bottom-up attention's adaptive mode keeps at most 100 regions
MAX_CHOICES, MAX_PHRASES = 8, 16  # multiple choice candidates, grounding phrases
MIN_TENSORRT = 10  # the name-based tensor API (set_input_shape, set_tensor_address, execute_async_v3)

Shapes = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # min, opt, max shape of one input
Profile = dict[str, Shapes]  # input name -> its shapes


@dataclass(frozen=True)
class Ranges:
    """The largest batch, text length and region count the engines take (the smallest is 1 each)."""

    max_batch: int = 32  # VLSERVE_MAX_BATCH_SIZE's default
    max_text: int = 64  # VLSERVE_MAX_TEXT_TOKENS' default
    max_regions: int = MAX_REGIONS

    def axes(self, batch: tuple[int, int, int] | None = None) -> dict[str, tuple[int, int, int]]:
        """(min, opt, max) of every symbolic axis of the graph specs; `batch` overrides the batch range."""
        return {"batch": batch or (1, max(1, self.max_batch // 2), self.max_batch),
                "text": (1, min(16, self.max_text), self.max_text),
                "regions": (1, min(36, self.max_regions), self.max_regions),
                "choices": (1, 4, MAX_CHOICES), "phrases": (1, 4, MAX_PHRASES)}


def input_shapes(spec: GraphSpec, axes: dict[str, tuple[int, int, int]]) -> Profile:
    """Min / opt / max shape of each input of `spec`: symbolic axes from `axes`, fixed ones as they are."""
    return {inp.name: tuple(tuple(axes[d][i] if isinstance(d, str) else d for d in inp.shape) for i in range(3))
            for inp in spec.inputs}


def choose_profile(profiles: list[Profile], shapes: dict[str, tuple[int, ...]]) -> int:
    """Index of the first profile whose min..max covers every input shape; ValueError naming the limits if none."""
    for index, profile in enumerate(profiles):
        if all(len(shapes[name]) == len(lo) and all(a <= s <= b for a, s, b in zip(lo, shapes[name], hi))
               for name, (lo, _, hi) in profile.items()):
            return index
    largest = {name: list(hi) for name, (_, _, hi) in profiles[-1].items()}
    raise ValueError(f"input shapes {({k: list(v) for k, v in shapes.items()})} are outside every optimisation "
                     f"profile of the TensorRT engine (largest: {largest}); export again with larger "
                     "--max-batch / --max-text / --max-regions")


# ---- what this machine has -----------------------------------------------------------------------------

def unavailable(device: str = "cuda") -> str | None:
    """Why TensorRT engines cannot be built or run on `device` here, in one sentence; None when they can."""
    try:
        import tensorrt as trt
    except (ImportError, OSError) as exc:  # OSError: the package is there but its CUDA libraries are not
        return (f"the tensorrt Python package cannot be imported ({exc}); on a machine with an NVIDIA GPU install "
                "it with `pip install -e '.[gpu]'` (docs/EXPORT.md)")
    if int(trt.__version__.split(".")[0]) < MIN_TENSORRT:
        return f"TensorRT {trt.__version__} is older than {MIN_TENSORRT} (install the `gpu` extra's version)"
    if not device.startswith("cuda"):
        return f"TensorRT engines run on a CUDA device (VLSERVE_DEVICE=cuda or cuda:N), not {device!r}"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device (TensorRT needs an NVIDIA GPU and a CUDA build of torch)"
    return None


def strongly_typed() -> bool:
    """Whether this TensorRT builds fp16 from an fp16 graph (11+: BuilderFlag.FP16 is gone) or by the flag (10)."""
    import tensorrt as trt

    return not hasattr(trt.BuilderFlag, "FP16")


def environment(device: str = "cuda") -> dict[str, str]:
    """TensorRT version, GPU and how fp16 was obtained: an engine only runs where these match."""
    import tensorrt as trt
    import torch

    index = _device_index(device)
    major, minor = torch.cuda.get_device_capability(index)
    return {"tensorrt": trt.__version__, "device": torch.cuda.get_device_name(index),
            "compute_capability": f"{major}.{minor}", "typing": "strong" if strongly_typed() else "weak"}


def _device_index(device: str) -> int:
    import torch

    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


@cache
def trt_logger():
    import tensorrt as trt

    return trt.Logger(trt.Logger.WARNING)  # one logger for every builder and runtime, as TensorRT asks


# ---- running -------------------------------------------------------------------------------------------

def _torch_dtype(dtype: np.dtype):
    import torch

    return torch.from_numpy(np.empty(0, dtype)).dtype


class TensorrtEngine:
    """One deserialized engine on one CUDA device: `run(feed) -> first output`, numpy in and out, thread-safe."""

    def __init__(self, path: str | Path, device: str = "cuda") -> None:
        import tensorrt as trt
        import torch

        self.path = Path(path)
        self.device = torch.device("cuda", _device_index(device))
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
            self.runtime = trt.Runtime(trt_logger())
            self.engine = self.runtime.deserialize_cuda_engine(self.path.read_bytes())
            if self.engine is None:
                raise ValueError(f"{self.path}: TensorRT {trt.__version__} cannot deserialize this engine (built by "
                                 "another TensorRT version or for another GPU? its log above says why)")
            names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
            self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
            self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
            self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in names}
            self.profiles: list[Profile] = [
                {n: tuple(tuple(int(x) for x in dims) for dims in self.engine.get_tensor_profile_shape(n, k))
                 for n in self.inputs}
                for k in range(self.engine.num_optimization_profiles)]
            # one context per profile: a context's profile is chosen once, so no batch waits for a switch
            self.contexts = []
            for k in range(len(self.profiles)):
                context = self.engine.create_execution_context()
                if context is None or not context.set_optimization_profile_async(k, self.stream.cuda_stream):
                    raise RuntimeError(f"{self.path.name}: no execution context for optimisation profile {k}")
                self.contexts.append(context)
            self.stream.synchronize()
        self._lock = threading.Lock()

    def run(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        """The engine's first output (logits) for `feed` (one array per engine input), as float32 numpy."""
        import torch

        missing = [n for n in self.inputs if n not in feed]
        if missing:
            raise ValueError(f"{self.path.name}: missing inputs {missing}")
        host = {n: np.ascontiguousarray(feed[n], dtype=self.dtypes[n]) for n in self.inputs}
        context = self.contexts[choose_profile(self.profiles, {n: a.shape for n, a in host.items()})]
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            buffers: dict[str, Any] = {}
            for name, array in host.items():
                buffers[name] = torch.from_numpy(array).to(self.device)  # copied on self.stream
                if not context.set_input_shape(name, array.shape):
                    raise ValueError(f"{self.path.name}: input {name} of shape {array.shape} refused by the engine")
            for name in self.outputs:
                shape = tuple(context.get_tensor_shape(name))
                buffers[name] = torch.empty(shape, dtype=_torch_dtype(self.dtypes[name]), device=self.device)
            for name, tensor in buffers.items():
                context.set_tensor_address(name, tensor.data_ptr())
            if not context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError(f"{self.path.name}: TensorRT execution failed (its log above says why)")
            self.stream.synchronize()
            return buffers[self.outputs[0]].cpu().numpy().astype(np.float32, copy=False)

    def close(self) -> None:
        self.contexts.clear()
        self.engine = None
