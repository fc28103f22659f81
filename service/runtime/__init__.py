"""Runtimes: execute one task on one padded numpy batch (torch here; onnxruntime / tensorrt plug in by name)."""
from .base import BATCH_KEYS, Runtime, UnknownTaskError, create_runtime

__all__ = ["BATCH_KEYS", "Runtime", "UnknownTaskError", "create_runtime"]
