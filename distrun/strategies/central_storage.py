"""CentralStorageStrategy: parameters and optimizer state live once, in host memory.

The chief (replica 0) owns the central copy of the parameters on the CPU and
the only optimizer. Every replica computes gradients on its own device copy;
at ``optimizer.step()`` the gradients are summed onto the chief (one flat
``reduce``), the chief averages them and applies the optimizer, and the new
parameters are broadcast back (one flat ``broadcast``). Updates are synchronous
and equal to one-device's.

Cost: two collectives per step that do not overlap backward (DDP's all-reduce
does), and the optimizer runs on one CPU. Benefit: optimizer state (Adam's two
moments, twice the parameter memory) exists once, not once per replica. Choose
it on one host when optimizer state is what does not fit, or when devices are
small and the host is large; choose mirrored otherwise. On a CPU-only host each
replica process still holds a compute copy of the parameters (its "device").
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from distrun.strategies.step.compile import plain_module
from distrun.strategies.base import Strategy, zero_grads

_CHIEF = 0


class _CentralOptimizer:
    """Stands in for the recipe's optimizer on every replica; only the chief's steps."""

    def __init__(self, inner: Any, central: list[torch.Tensor], replica: list[nn.Parameter],
                 buffers: tuple[list[torch.Tensor], list[torch.Tensor]], world_size: int, comm_device: torch.device):
        self._inner = inner  # None on non-chief replicas: no optimizer state there
        self._central = central
        self._replica = replica
        self._central_buffers, self._replica_buffers = buffers
        self._world = world_size
        self._comm_device = comm_device

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups if self._inner is not None else []

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads(self._replica, set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._replica]
        flat = _flatten_dense_tensors(grads).to(self._comm_device)
        dist.reduce(flat, dst=_CHIEF, op=dist.ReduceOp.SUM)
        if self._inner is not None:
            flat.div_(self._world)
            for c, g in zip(self._central, _unflatten_dense_tensors(flat, grads)):
                c.grad = g.to(c.device)
            self._inner.step()
        self._broadcast_central()

    @torch.no_grad()
    def _broadcast_central(self) -> None:
        tensors = list(self._central) + list(self._central_buffers)
        targets = list(self._replica) + list(self._replica_buffers)
        if not tensors:
            return
        flat = _flatten_dense_tensors([t.detach() for t in tensors]).to(self._comm_device)
        dist.broadcast(flat, src=_CHIEF)
        for dst, src in zip(targets, _unflatten_dense_tensors(flat, tensors)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict() if self._inner is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._inner is not None:
            self._inner.load_state_dict(state)


class CentralStorageStrategy(Strategy):
    name = "central-storage"

    def _wrap(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        central_model = model
        compute_model = copy.deepcopy(model).to(self.device) if self.device.type != "cpu" else model
        central = list(central_model.parameters())
        replica = list(compute_model.parameters())
        float_buffers = lambda m: [b for b in m.buffers() if b.is_floating_point()]  # noqa: E731
        comm = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        wrapped = _CentralOptimizer(
            optimizer if self.is_chief else None,
            central,
            replica,
            (float_buffers(central_model), float_buffers(compute_model)),
            self.num_replicas,
            comm,
        )
        self._central_model = central_model
        wrapped._broadcast_central()  # every replica starts from the chief's parameters
        return compute_model, wrapped

    def _sync_wait_s(self, timed_s: float | None) -> float | None:
        """The replicas meet in the central optimizer's reduce, step and broadcast, where the chief
        also computes: waiting and computing are not told apart there, so no figure is claimed."""
        return None

    def lr_optimizers(self) -> list[torch.optim.Optimizer]:
        """The chief's optimizer: the only one that steps (the other replicas have none)."""
        inner = self._stepping_optimizer(self._wrapped_optimizer)
        return [inner] if inner is not None else []

    def _stepping_optimizer(self, optimizer: Any) -> torch.optim.Optimizer | None:
        """The chief's optimizer, on the central parameters and the averaged gradients."""
        return optimizer._inner if isinstance(optimizer, _CentralOptimizer) else None

    def unwrap(self, model: nn.Module | None = None) -> nn.Module:
        if model is None and getattr(self, "_central_model", None) is not None:
            return plain_module(self._central_model)
        return super().unwrap(model)

    def compute_model(self) -> nn.Module:
        """This replica's device copy: the central one lives on the CPU, where a GPU batch cannot meet it."""
        return super().unwrap()

    def _after_restore(self) -> None:
        self._optimizer._broadcast_central()
