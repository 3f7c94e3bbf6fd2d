"""Whole state into a sharded model: rank 0's initial values, or a plain checkpoint.

Every rank passes the same full ``state_dict`` (a plain ``ckpt-<step>.pt``, loaded whole) and
keeps its own shards of it; the optimizer's state comes in torch's index-keyed layout and is
turned back into names first. So a mirrored or one-device checkpoint resumes under sharded at
any rank count. (Sharded's own checkpoints are DCP folders: ``sharding/checkpoint.py``.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

from distrun.strategies.checkpoint import layout

__all__ = ["broadcast_from_rank0", "load_full_model_state", "load_full_optimizer_state", "on_cpu", "on_meta",
           "same_rng_as_rank0"]

_SCATTER = StateDictOptions(full_state_dict=True)


def on_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (every rank but 0 builds it there)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def on_cpu(state: dict[str, Any]) -> dict[str, Any]:
    """A state_dict's tensors on the CPU (rank 0's initial values, kept while the model is split)."""
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def same_rng_as_rank0(device: torch.device) -> None:
    """Every rank takes rank 0's CPU random state. Only rank 0 drew from it to initialise the model
    (the others built theirs on the meta device), and the ranks of one model-parallel replica must
    draw alike afterwards (dropout in replicated modules, augmentation), as mirrored's replicas,
    which all build the model, do."""
    state = torch.get_rng_state().to(device)
    dist.broadcast(state, src=0)
    torch.set_rng_state(state.cpu())


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


def load_full_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Each rank keeps its shards of a full state_dict (every rank passes the same one)."""
    set_model_state_dict(model, state, options=_SCATTER)


def load_full_optimizer_state(model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    """The index-keyed layout back to names, then each rank keeps its shards."""
    names = {id(param): name for name, param in model.named_parameters()}
    order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    set_optimizer_state_dict(model, optimizer, layout.named(state, order), options=_SCATTER)
