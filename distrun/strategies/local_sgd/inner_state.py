"""Every replica's inner optimizer state, gathered into the chief's checkpoint as tensors.

Under DiLoCo each replica keeps its own optimizer state across syncs (its Adam moments saw
only its data), so a checkpoint holds one per replica. The states have the same structure on
every replica (one model, one optimizer class, stepped the same number of times; checked first),
so the chief gathers them with ``dist.gather``, a flat buffer per dtype, into copies of its own
structure: no pickle crosses the wire, only the tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distrun.errors import CheckpointError

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
    Every replica calls it. ``device``: where the backend's collectives run.

    First every replica's shape of the state (how many tensors, how many elements) is gathered:
    states that differ (an optimizer that made no state for a parameter no batch of this
    replica reached) would otherwise make the replicas gather different tensors and hang.
    Then one gather per dtype, of that dtype's tensors flattened.
    """
    mine: list[torch.Tensor] = []
    _tensors(state, mine)
    shape = torch.tensor([len(mine), sum(t.numel() for t in mine)], dtype=torch.int64, device=device)
    shapes = [torch.empty_like(shape) for _ in range(members)]
    dist.all_gather(shapes, shape)
    if any(not torch.equal(other, shapes[0]) for other in shapes):
        described = ", ".join(f"replica {r}: {int(s[0])} tensors of {int(s[1])} elements" for r, s in enumerate(shapes))
        raise CheckpointError(f"diloco checkpoint: the replicas' inner optimizer states differ in shape ({described}); "
                              "an optimizer made state for parameters that only some replicas' batches reach")
    gathered: list[list[torch.Tensor | None]] = [[None] * len(mine) for _ in range(members)]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(mine):
        by_dtype.setdefault(tensor.dtype, []).append(index)
    for dtype, indices in by_dtype.items():
        flat = torch.cat([mine[i].detach().reshape(-1) for i in indices]).to(device)
        parts = [torch.empty_like(flat) for _ in range(members)] if rank == 0 else None
        dist.gather(flat, parts, dst=0)
        if parts is None:
            continue
        for r, part in enumerate(parts):
            offset = 0
            for i in indices:
                count = mine[i].numel()
                gathered[r][i] = part[offset:offset + count].view(mine[i].shape).cpu().clone()
                offset += count
    if rank != 0:
        return []
    return [_replace(state, list(values)) for values in gathered]
