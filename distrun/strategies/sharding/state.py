"""A sharded model's state in the plain checkpoint format every strategy reads and writes.

``ckpt-<step>.pt`` holds the model's full ``state_dict`` and the optimizer's in torch's own
layout (state keyed by each parameter's index in the groups). Every rank takes part in
gathering the shards (a collective); only rank 0 receives the full tensors, on the CPU, and
writes them. So a sharded checkpoint resumes under one-device or mirrored, and theirs under
sharded, whatever the number of ranks on either side.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["broadcast_from_rank0", "full_model_state", "full_optimizer_state", "load_full_model_state",
           "load_full_optimizer_state"]

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SCATTER = StateDictOptions(full_state_dict=True)


def broadcast_from_rank0(model: nn.Module, state: dict[str, Any], device: torch.device) -> None:
    """Rank 0's ``state`` (its full state_dict; ``{}`` elsewhere) into every rank's shards, and
    every buffer (persistent or not: a state_dict leaves some out) from rank 0's."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for buffer in model.buffers():
            staged = buffer.detach().to(device)
            dist.broadcast(staged, src=0)
            if staged is not buffer:
                buffer.copy_(staged)


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """The full state_dict on rank 0 (empty elsewhere); every rank must call it."""
    return get_model_state_dict(model, options=_GATHER)


def full_optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's full state in torch's index-keyed layout on rank 0 (empty elsewhere)."""
    named = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if not named:
        return {}
    order = [name for group in named["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {"state": {index[name]: state for name, state in named["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in named["param_groups"]]}


def load_full_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Each rank keeps its shards of a full state_dict (every rank passes the same one)."""
    set_model_state_dict(model, state, options=_SCATTER)


def load_full_optimizer_state(model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    """The index-keyed layout back to names, then each rank keeps its shards."""
    names = {id(param): name for name, param in model.named_parameters()}
    order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    named = {"state": {order[int(i)]: value for i, value in state.get("state", {}).items()},
             "param_groups": [{**group, "params": [order[int(i)] for i in group["params"]]}
                              for group in state.get("param_groups", [])]}
    set_optimizer_state_dict(model, optimizer, named, options=_SCATTER)
