"""The random generators a checkpoint keeps, and their JSON form for a sharded checkpoint's sidecar.

distrun itself draws nothing on the device (data order and initial parameters come from the
CPU generator), so a checkpoint moves between CPU and CUDA with the same next batch; the
CUDA state only keeps a recipe's own device draws (dropout) going where the device is the
same. The chief's generators are the ones kept, and every replica restores them.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import torch

__all__ = ["rng_state", "set_rng_state", "rng_to_json", "rng_from_json"]

_TENSORS = ("torch", "cuda")


def rng_state() -> dict[str, Any]:
    """The generators a recipe may draw from: CPU torch, Python, and CUDA's when in use."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(rng: dict[str, Any], device: torch.device) -> None:
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "python" in rng:
        random.setstate(_as_tuple(rng["python"]))
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)


def rng_to_json(rng: dict[str, Any]) -> dict[str, Any]:
    """Byte tensors as base64 text; Python's state as lists."""
    return {key: base64.b64encode(value.numpy().tobytes()).decode("ascii") if key in _TENSORS else value
            for key, value in rng.items()}


def rng_from_json(rng: dict[str, Any]) -> dict[str, Any]:
    return {key: torch.frombuffer(bytearray(base64.b64decode(value)), dtype=torch.uint8) if key in _TENSORS
            else value for key, value in rng.items()}


def _as_tuple(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_as_tuple(v) for v in value)
    return value
