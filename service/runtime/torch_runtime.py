"""The reference runtime: the checkpoint's VLModel in eval mode under torch.inference_mode, float32 weights.

Precision (`VLSERVE_PRECISION`): "fp32", or "bf16": the encoder's GEMMs and attention in bfloat16 with float32
LayerNorm and residuals, as training's autocast (on the CPU through `models.layers.set_cpu_gemm_dtype`'s packed
bfloat16 weights, on CUDA under autocast). "auto" picks bf16 where the hardware computes it natively. On these
2-core AVX512-BF16 machines the demo encoder runs batch 32 about 1.9x and batch 1 about 1.4x faster, within 0.06
accuracy points (docs/BENCHMARKS.md).

For two-stream encoders (ViLBERT, LXMERT) it also runs each stream alone and the fusion layers over cached
states (`splits_streams`): the service's retrieval then encodes every image and every text once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from models import layers
from models.attention import explained_forward
from models.checkpoint import Checkpoint
from models.inputs import VLInputs
from models.two_stream import StreamStates

from .base import FLOAT_KEYS, Runtime, UnknownTaskError, create_runtime

if TYPE_CHECKING:
    from ..settings import Settings

__all__ = ["TorchRuntime", "create", "create_runtime", "to_inputs", "to_tensors"]


def to_tensors(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """numpy arrays -> tensors on `device`: float keys as float32 (stored features are float16), the rest int64.

    Arrays already of that dtype are shared with numpy, not copied (on the CPU)."""
    tensors = {}
    for key, value in batch.items():
        dtype = np.float32 if key in FLOAT_KEYS else np.int64
        tensors[key] = torch.from_numpy(np.ascontiguousarray(value, dtype=dtype)).to(device)
    return tensors


def to_inputs(batch: dict[str, np.ndarray], device: torch.device) -> VLInputs:
    """numpy batch -> VLInputs on `device` (see to_tensors)."""
    return VLInputs(**to_tensors(batch, device))


def text_lengths(attention_mask: np.ndarray) -> list[int]:
    """Per row, the position after its last real token (rows are cut there before they are cached)."""
    real = np.asarray(attention_mask) != 0
    return [int(np.flatnonzero(row)[-1]) + 1 if row.any() else 1 for row in real]


bf16_unavailable = layers.bf16_unavailable  # why bfloat16 would not be fast on a device (None: it is)


def device_unavailable(device: str) -> str | None:
    """Why torch cannot run on `device` ("cpu", "cuda", "cuda:N"), or None when it can."""
    if not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return f"device {device!r} requested but torch sees no CUDA device"
    index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
    if index >= count:
        return f"device {device!r} requested but torch sees {count} CUDA device{'s' * (count != 1)}"
    return None


def resolve_precision(precision: str, device: torch.device) -> str:
    """"fp32" or "bf16" for a requested "auto" / "fp32" / "bf16"; ValueError when bf16 is asked and not fast here."""
    if precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"unknown precision {precision!r}; choose auto, fp32 or bf16")
    if precision == "fp32":
        return "fp32"
    reason = bf16_unavailable(device)
    if reason and precision == "bf16":
        raise ValueError(f"precision 'bf16' on {device.type}: {reason}; use VLSERVE_PRECISION=fp32 or auto")
    return "fp32" if reason else "bf16"


class TorchRuntime(Runtime):
    name = "torch"

    def __init__(self, checkpoint: Checkpoint, device: str = "cpu", threads: int = 2, precision: str = "fp32") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if why := device_unavailable(device):
            raise ValueError(why)
        torch.set_num_threads(threads)  # process-wide: the service runs one model set per process
        self.device = torch.device(device)
        self.precision = resolve_precision(precision, self.device)
        self.model = checkpoint.model.to(self.device).float().eval()
        if self.device.type == "cpu":
            layers.set_cpu_gemm_dtype(self.model, torch.bfloat16 if self.precision == "bf16" else torch.float32)
        self.tasks = {task: head.kind for task, head in self.model.config.heads.items()}

    def _autocast(self) -> torch.autocast:
        """bfloat16 autocast on CUDA (the CPU path casts inside models.layers.Linear instead: no per-call weight casts)."""
        enabled = self.precision == "bf16" and self.device.type == "cuda"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def run(self, task: str, batch: dict[str, np.ndarray]) -> np.ndarray:
        self.check_batch(task, batch)
        inputs = to_inputs(batch, self.device)
        with torch.inference_mode(), self._autocast():
            logits = self.model(inputs, task).logits
        return logits.float().cpu().numpy()

    def explain(self, task: str, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        self.check_batch(task, batch)
        inputs = to_inputs(batch, self.device)
        with torch.inference_mode(), self._autocast():
            logits, attention = explained_forward(self.model, inputs, task)
        return logits.float().cpu().numpy(), [a.float().cpu().numpy() for a in attention]

    def splits_streams(self, task: str) -> bool:
        # the ITM head reads the fused streams and the regions' mask alone (VLModel.match_streams); a head whose
        # inputs carry a task token (ViLBERT 12-in-1) runs whole, as the cached text states hold no task token
        return (hasattr(self.model.encoder, "fuse") and self.tasks.get(task) == "itm"
                and self.model.config.heads[task].task_token < 0)

    def encode_texts(self, batch: dict[str, np.ndarray]) -> list[StreamStates]:
        t = to_tensors(batch, self.device)
        with torch.inference_mode(), self._autocast():
            states = self.model.encoder.encode_text(t["input_ids"], t["attention_mask"], t["token_type_ids"])
        return [states.row(i, n) for i, n in enumerate(text_lengths(batch["attention_mask"]))]

    def encode_images(self, batch: dict[str, np.ndarray]) -> list[StreamStates]:
        t = to_tensors(batch, self.device)
        with torch.inference_mode(), self._autocast():
            states = self.model.encoder.encode_image(t["region_features"], t["region_boxes"], t["region_mask"],
                                                     t.get("image_feature"))
        return [states.row(i) for i in range(states.hidden.shape[0])]

    def fuse(self, task: str, texts: list[StreamStates], images: list[StreamStates]) -> np.ndarray:
        if not self.splits_streams(task):
            raise UnknownTaskError(f"task {task!r} does not run on split streams in this model")
        if len(texts) != len(images):
            raise ValueError(f"{len(texts)} text states for {len(images)} image states")
        with torch.inference_mode(), self._autocast():
            logits = self.model.match_streams(task, StreamStates.cat(texts), StreamStates.cat(images))
        return logits.float().cpu().numpy()


def create(settings: Settings, checkpoint: Checkpoint) -> TorchRuntime:
    return TorchRuntime(checkpoint, device=settings.device, threads=settings.threads, precision=settings.precision)
