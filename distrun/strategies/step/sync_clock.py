"""How long a replica's step waited for its peers: what separates its compute time from its step time.

Under a synchronous strategy every replica's step ends at the same moment (the gradients'
all-reduce, or FSDP's gathers, wait for the slowest), so step times cannot name a slow
replica; the time each one spent waiting can. A step's wait is measured where it happens:

- **Gradients** (DDP under mirrored and multi-worker): from the moment this replica's last parameter
  gradient was accumulated (``register_post_accumulate_grad_hook``) to the optimizer's
  step (``register_step_pre_hook``). In between, DDP waits for the buckets' all-reduce,
  which waits for the slowest replica.
- **Shards** (FSDP2 under sharded): the time inside each FSDP parameter group's
  ``unshard``, ``wait_for_unshard`` and ``post_backward``, where FSDP all-gathers a block's
  parameters (in forward and again in backward) and reduce-scatters its gradients, each of
  which waits for the slowest rank. These are FSDP's own methods, timed on each group
  instance (not patched on the class); on a torch whose FSDP2 lacks them the clock
  ``measures`` nothing, and no compute time is claimed.

A strategy whose replicas meet where waiting and computing cannot be told apart
(central-storage's central optimizer) does not ask the clock (``Strategy._sync_wait_s``).

A straggler's wait is only the transfer itself; its peers' is that plus its lateness. One
perf_counter read per gradient or per FSDP call: no device sync, no collective.

On a GPU these CPU clocks do not see the wait: DDP's and FSDP's waits only order CUDA
streams, and the CPU blocks later, wherever the step first reads a value back. Timing them
needs CUDA events on the compute stream, which distrun does not record yet; a CUDA replica's
clock says it ``measures`` nothing, and its compute time is reported as unknown rather than
wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["SyncClock"]


class SyncClock:
    """Per step: ``begin()``, then the hooks add up the wait; ``waited_s()`` reads it."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._ready_at: float | None = None
        self._waited_s = 0.0
        self._timed_groups: list[Any] = []

    @property
    def measures(self) -> bool:
        """Whether the waits are timed: hooks installed, on a CPU replica."""
        return bool(self._handles or self._timed_groups)

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
        """Hook ``model``'s parameters and sharded modules, and ``optimizer``'s step (again after a rebuild)."""
        self.close()
        if device.type != "cpu":  # CPU clocks see no wait on a GPU (the module's docstring)
            return
        groups = _fsdp_param_groups(model)
        if groups:  # sharded: FSDP's collectives are the waits (its gradients arrive after them)
            for group in groups:
                self._time_group(group)
            return
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._optimizer_steps))
            for param in model.parameters():
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._gradient_ready))

    def begin(self) -> None:
        self._ready_at = None
        self._waited_s = 0.0

    def waited_s(self) -> float:
        return self._waited_s

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for group in self._timed_groups:
            for name in _FSDP_WAITS:
                group.__dict__.pop(name, None)  # the class's method again
        self._timed_groups.clear()

    def _gradient_ready(self, _param: torch.Tensor) -> None:
        self._ready_at = time.perf_counter()

    def _optimizer_steps(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._ready_at is not None:
            self._waited_s += time.perf_counter() - self._ready_at
            self._ready_at = None

    def _time_group(self, group: Any) -> None:
        if not all(callable(getattr(group, name, None)) for name in _FSDP_WAITS):
            return
        for name in _FSDP_WAITS:
            setattr(group, name, self._timed(getattr(group, name)))
        self._timed_groups.append(group)

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._waited_s += time.perf_counter() - started

        return timed


#: FSDP2's FSDPParamGroup methods that hold its collectives (the gathers, the reduce-scatter).
_FSDP_WAITS = ("unshard", "wait_for_unshard", "post_backward")


def _fsdp_param_groups(model: nn.Module) -> list[Any]:
    """Every FSDP2 parameter group in ``model`` (empty when it is not sharded)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    groups: list[Any] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            found = getattr(state, "_fsdp_param_groups", None)
            if found is None:  # older FSDP2: one group per state
                found = [getattr(state, "_fsdp_param_group", None)]
            groups.extend(group for group in found if group is not None and group not in groups)
    return groups
