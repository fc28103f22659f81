"""The reference runtime: the checkpoint's VLModel in eval mode, float32, under torch.inference_mode."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from models.checkpoint import Checkpoint
from models.inputs import VLInputs

from .base import FLOAT_KEYS, Runtime, create_runtime

if TYPE_CHECKING:
    from ..settings import Settings

__all__ = ["TorchRuntime", "create", "create_runtime", "to_inputs"]


def to_inputs(batch: dict[str, np.ndarray], device: torch.device) -> VLInputs:
    """numpy batch -> VLInputs on `device`: float keys as float32 (stored features are float16), the rest int64."""
    tensors = {}
    for key, value in batch.items():
        dtype = np.float32 if key in FLOAT_KEYS else np.int64
        tensors[key] = torch.from_numpy(np.ascontiguousarray(value, dtype=dtype)).to(device)
    return VLInputs(**tensors)


class TorchRuntime(Runtime):
    name = "torch"

    def __init__(self, checkpoint: Checkpoint, device: str = "cpu", threads: int = 2) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but torch sees no CUDA device")
        torch.set_num_threads(threads)  # process-wide: the service runs one model set per process
        self.device = torch.device(device)
        self.model = checkpoint.model.to(self.device).float().eval()
        self.tasks = {task: head.kind for task, head in self.model.config.heads.items()}

    def run(self, task: str, batch: dict[str, np.ndarray]) -> np.ndarray:
        self.check_batch(task, batch)
        inputs = to_inputs(batch, self.device)
        with torch.inference_mode():
            logits = self.model(inputs, task).logits
        return logits.float().cpu().numpy()


def create(settings: Settings, checkpoint: Checkpoint) -> TorchRuntime:
    return TorchRuntime(checkpoint, device=settings.device, threads=settings.threads)
