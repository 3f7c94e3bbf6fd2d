"""A sharded model's state as DCP shards: what each rank saves, and loading it back on any mesh.

Each rank hands DCP its own pieces (the DTensors ``get_model_state_dict`` and
``get_optimizer_state_dict`` give, keyed by parameter name): no rank gathers the whole.
Loading asks the same of the model as it is now (its mesh may differ from the writer's), and
DCP reads, from each writer's file, the rows this rank's shards cover: 4 ranks' checkpoint
onto 2, or HSDP's onto a flat mesh, is the same call.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from distrun.strategies.checkpoint import layout, shard_reader

__all__ = ["sharded_state", "load_sharded"]


def sharded_state(model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this rank's tensors for DCP, the JSON rest: optimizer groups and non-tensor state)."""
    optimizer_state = get_optimizer_state_dict(model, optimizer) if optimizer is not None else None
    return layout.split(get_model_state_dict(model), optimizer_state)


def load_sharded(path: str | os.PathLike[str], model: nn.Module, optimizer: Any, sidecar: dict[str, Any]) -> None:
    """Fill ``model``'s shards and ``optimizer``'s state from the checkpoint folder ``path``,
    every rank together. The optimizer's groups come back as saved (a schedule's learning rate
    lives there), as a plain checkpoint's ``load_state_dict`` restores them."""
    tensors, _ = sharded_state(model, optimizer)  # the targets: this rank's pieces, as the model is sharded now
    loaded = shard_reader.load_into(path, tensors)
    model_state, optimizer_state = layout.join({key: tensors[key] for key in loaded}, sidecar)
    set_model_state_dict(model, model_state)
    if optimizer is not None and optimizer_state is not None and optimizer_state["param_groups"]:
        set_optimizer_state_dict(model, optimizer, optimizer_state)
