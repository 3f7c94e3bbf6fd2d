"""Moving nested batches (tensors in tuples, lists, dicts) to a device."""

from __future__ import annotations

from typing import Any

import torch


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1
