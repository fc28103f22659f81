"""Where training and evaluation run: the CPU (the default, and every built model's arithmetic) or a CUDA GPU
(`--device cuda[:N]`). Batches are collated on the CPU and moved; metrics and checkpoints come back to the CPU."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn


def resolve_device(name: str) -> torch.device:
    """torch.device for "cpu", "cuda" or "cuda:N"; ValueError (before any data is prepared) for another name, or a GPU
    torch cannot see."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {name!r} unknown: choose cpu, cuda or cuda:N") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} unknown: choose cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: torch sees no CUDA GPU here (train on cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def to_device(value, device: torch.device):
    """value with every tensor in it (dicts, lists, tuples, dataclasses such as VLInputs) on device; a no-op on the
    CPU."""
    if device.type == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: to_device(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def autocast(enabled: bool, device: torch.device | str = "cpu"):
    """bfloat16 autocast on device when enabled (weights, optimizer state and the loss stay float32)."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=enabled)


def rng_state(device: torch.device) -> dict:
    """The torch generators a run draws from: the CPU's, and the GPU's when it trains on one (dropout there)."""
    state = {"torch_rng": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch_rng"])
    if device.type == "cuda" and "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], device)
