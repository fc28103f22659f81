"""The runtime contract (DESIGN.md): run one task on one padded batch of numpy arrays, return numpy logits."""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint

    from ..settings import Settings

# Batch keys are VLInputs field names. Text arrays (B, T) ((B, C, T) for multiple choice), regions
# (B, N, ...) ((B, 2, N, ...) for NLVR2 pairs), region_boxes normalized to [0, 1].
INT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "region_mask", "tag_ids", "phrase_index")
FLOAT_KEYS = ("region_features", "region_boxes", "image_feature")
REQUIRED_KEYS = ("input_ids", "attention_mask", "token_type_ids", "region_features", "region_boxes", "region_mask")
BATCH_KEYS = REQUIRED_KEYS + ("image_feature", "tag_ids", "phrase_index")

# runtime name -> (module that implements it, what it needs); a module exposes `create(settings, checkpoint)`.
BACKENDS = {
    "torch": ("service.runtime.torch_runtime", "torch"),
    "onnxruntime": ("service.runtime.onnx_runtime", "the onnxruntime package and an exported model repository (export issue)"),
    "tensorrt": ("service.runtime.tensorrt_runtime", "TensorRT on a CUDA GPU and an exported model repository (export issue)"),
}


class UnknownTaskError(KeyError):
    """The model has no head for the requested task."""

    def __str__(self) -> str:
        return str(self.args[0])


class Runtime(ABC):
    """One loaded model set on one backend. `run` is synchronous and thread-safe (batchers call it from threads)."""

    name: str  # backend name: "torch", "onnxruntime", "tensorrt"
    tasks: dict[str, str]  # task name -> head kind ("vqa", "refer", "itm", "nlvr2", ...) from the checkpoint config
    precision: str = "fp32"  # the arithmetic the encoder runs in: "fp32", "bf16", "fp16" or "int8"

    @abstractmethod
    def run(self, task: str, batch: dict[str, np.ndarray]) -> np.ndarray:
        """Logits of `task` for a padded batch (keys: BATCH_KEYS); rows follow the batch's first axis."""

    def close(self) -> None:
        """Release backend resources (sessions, GPU memory)."""

    def explain(self, task: str, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """`run`'s logits and, per image of each row in order (two per row for NLVR2), the attention of the text
        tokens over the region slots at each layer where text meets regions: (L, heads, T, N) (explain=true)."""
        raise NotImplementedError(f"the {self.name} runtime does not return attention; the torch runtime does")

    # Two-stream retrieval: a runtime that can run each stream alone lets the service cache every image's and
    # every text's single-modality states and run only the fusion layers per (text, image) pair. States are
    # opaque to the service: one object per row with an `nbytes` attribute.

    def splits_streams(self, task: str) -> bool:
        """Whether encode_texts / encode_images / fuse serve `task` (default: no, the full graph runs per pair)."""
        return False

    def encode_texts(self, batch: dict[str, np.ndarray]) -> list[Any]:
        """Text-stream states of each row of a padded text batch (input_ids, attention_mask, token_type_ids)."""
        raise NotImplementedError(f"runtime {self.name} does not split the streams")

    def encode_images(self, batch: dict[str, np.ndarray]) -> list[Any]:
        """Image-stream states of each row of a padded region batch (region_*, optional image_feature)."""
        raise NotImplementedError(f"runtime {self.name} does not split the streams")

    def fuse(self, task: str, texts: list[Any], images: list[Any]) -> np.ndarray:
        """Logits of `task` for the pairs (texts[i], images[i]), from states made by encode_texts / encode_images."""
        raise NotImplementedError(f"runtime {self.name} does not split the streams")

    def check_batch(self, task: str, batch: dict[str, np.ndarray]) -> None:
        """Raise UnknownTaskError / ValueError naming what is wrong with a (task, batch) before running it."""
        if task not in self.tasks:
            raise UnknownTaskError(f"model has no task {task!r}; it has: {', '.join(self.tasks) or 'none'}")
        missing = [k for k in REQUIRED_KEYS if k not in batch]
        unknown = [k for k in batch if k not in BATCH_KEYS]
        if missing or unknown:
            raise ValueError(f"batch for {task!r}: missing {missing or 'nothing'}, unknown {unknown or 'nothing'}")
        rows = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
        if len(set(rows.values())) != 1 or None in rows.values():
            raise ValueError(f"batch for {task!r}: arrays disagree on the batch size: {rows}")


def create_runtime(settings: Settings, checkpoint: Checkpoint) -> Runtime:
    """The runtime settings.runtime names; ValueError naming what is missing when it is not available here."""
    try:
        module_name, needs = BACKENDS[settings.runtime]
    except KeyError:
        raise ValueError(f"unknown runtime {settings.runtime!r}; choose one of {', '.join(BACKENDS)}") from None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"runtime {settings.runtime!r} is not available: it needs {needs} "
                         f"(module {exc.name} is not installed)") from None
    return module.create(settings, checkpoint)
