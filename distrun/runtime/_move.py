"""Moving nested batches (tensors in tuples, lists, dicts) to a device."""

from __future__ import annotations

from typing import Any

import torch

from distrun.strategies.data.plan import batch_len

__all__ = ["to_device", "batch_len"]


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
