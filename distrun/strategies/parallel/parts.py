"""A pipelined rank's stages as one model and one optimizer, and their state as the whole model's.

Under ``--pp`` a rank holds one stage, or two under the interleaved schedules, each a pruned
copy of the model that FSDP2 wraps as its own root (torchtitan's model parts). ``PipelineParts``
holds them for what the training loop does to "the model" (train/eval mode, evaluation's
reshard), and ``PipelineOptimizer`` steps an optimizer per part, after clipping the gradients'
norm over every stage of the replica (each rank's parts, then an all-reduce over the pipeline).

Checkpoints keep the whole model's names: each part's state is keyed as in the whole model, so
the parts' (and the pipeline ranks') states are disjoint pieces of one state, merged here for
the sidecar the chief writes, and restricted to a part's own names when read back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distrun.errors import RecipeError

__all__ = ["PipelineParts", "PipelineOptimizer", "merge_rest", "restricted"]


class PipelineParts(nn.Module):
    """This rank's stages, in stage order. Not callable: the pipeline schedule runs them."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RecipeError("--pp: a rank holds pipeline stages, which cannot be called as one model; "
                          "strategy.forward_backward(...) trains a batch and evaluation runs the pipeline")


class PipelineOptimizer:
    """One optimizer per part, stepped together; ``--clip-grad-norm`` over the whole replica first."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], *, clip: float | None,
                 group: dist.ProcessGroup) -> None:
        self.optimizers = list(optimizers)
        self._clip = clip
        self._group = group

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The first part's groups (a learning rate, as the live view and TensorBoard read it)."""
        return self.optimizers[0].param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        if self._clip:
            self._clip_grad_norm(self._clip)
        for optimizer in self.optimizers:
            optimizer.step()

    def _clip_grad_norm(self, max_norm: float) -> float:
        """torch's clip over every stage: each rank's sum of squares (DTensors made whole over their
        mesh), summed over the pipeline, one coefficient for all."""
        grads = [p.grad for optimizer in self.optimizers for group in optimizer.param_groups
                 for p in group["params"] if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64)
        if grads:
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            squares = norm.detach().double().cpu() ** 2
        device = grads[0].device if grads and dist.get_backend(self._group) == "nccl" else torch.device("cpu")
        squares = squares.to(device)
        dist.all_reduce(squares, group=self._group)
        total = math.sqrt(float(squares))
        coefficient = max_norm / (total + 1e-6)  # torch's clip_grads_with_norm_, clamped at 1
        if coefficient < 1.0:
            with torch.no_grad():
                for grad in grads:
                    grad.mul_(coefficient)
        return total

    def state_dict(self) -> dict[str, Any]:
        raise RecipeError("--pp: the optimizer's state is each stage's; strategy.save() writes it whole")


def merge_rest(rests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The JSON rest of each part's ``layout.split`` (in stage order) as one model's: the model's
    non-tensor entries and the optimizer's state together, each param group's names concatenated."""
    merged: dict[str, Any] = {"model": {}, "optimizer": None}
    for rest in rests:
        merged["model"].update(rest.get("model") or {})
        optimizer = rest.get("optimizer")
        if optimizer is None:
            continue
        if merged["optimizer"] is None:
            merged["optimizer"] = {"state": {}, "param_groups": [dict(g, params=list(g["params"]))
                                                                 for g in optimizer["param_groups"]]}
        else:
            for mine, theirs in zip(merged["optimizer"]["param_groups"], optimizer["param_groups"]):
                mine["params"].extend(theirs["params"])
        merged["optimizer"]["state"].update(optimizer.get("state") or {})
    return merged


def restricted(optimizer_state: dict[str, Any] | None, names: set[str]) -> dict[str, Any] | None:
    """A name-keyed optimizer state cut down to the parameters ``names`` (one part's)."""
    if optimizer_state is None:
        return None
    return {"state": {name: value for name, value in optimizer_state.get("state", {}).items() if name in names},
            "param_groups": [{**group, "params": [name for name in group["params"] if name in names]}
                             for group in optimizer_state.get("param_groups", [])]}
