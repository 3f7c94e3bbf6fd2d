"""Every replica's inner optimizer state, gathered into the chief's checkpoint as tensors.

Under DiLoCo each replica keeps its own optimizer state across syncs (its Adam moments saw
only its data), so a checkpoint holds one per replica. The states have the same structure on
every replica (one model, one optimizer class, stepped the same number of times), so the chief
gathers them tensor by tensor with ``dist.gather`` into copies of its own: no pickle crosses
the wire, only the tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_states"]


def _tensors(state: Any, found: list[torch.Tensor]) -> None:
    if isinstance(state, torch.Tensor):
        found.append(state)
    elif isinstance(state, dict):
        for key in sorted(state, key=str):
            _tensors(state[key], found)
    elif isinstance(state, (list, tuple)):
        for item in state:
            _tensors(item, found)


def _replace(state: Any, values: list[torch.Tensor]) -> Any:
    """``state`` with its tensors (in ``_tensors``' order) taken from ``values``, front first."""
    if isinstance(state, torch.Tensor):
        return values.pop(0)
    if isinstance(state, dict):
        replaced = {key: _replace(state[key], values) for key in sorted(state, key=str)}
        return {key: replaced[key] for key in state}
    if isinstance(state, (list, tuple)):
        return type(state)(_replace(item, values) for item in state)
    return state


def gather_states(state: dict[str, Any], *, rank: int, members: int, device: torch.device) -> list[dict[str, Any]]:
    """On rank 0: every replica's ``state`` (its own first), on the host; elsewhere an empty list.
    Every replica calls it. ``device``: where the backend's collectives run."""
    mine: list[torch.Tensor] = []
    _tensors(state, mine)
    gathered: list[list[torch.Tensor]] = [[] for _ in range(members)]
    for tensor in mine:
        on_wire = tensor.detach().to(device)
        parts = [torch.empty_like(on_wire) for _ in range(members)] if rank == 0 else None
        dist.gather(on_wire, parts, dst=0)
        if parts is not None:
            for r, part in enumerate(parts):
                gathered[r].append(part.cpu())
    if rank != 0:
        return []
    return [_replace(state, list(values)) for values in gathered]
