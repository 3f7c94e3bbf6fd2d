"""Mixed precision for a replica's step: autocast, and a loss scaler every replica agrees with.

Precision is a property of the step, not of a strategy, so one module serves all of
them and the fit loop alike:

* ``autocast(device, precision)``: ``torch.autocast`` to bf16 or fp16 around the step
  (forward and loss; the backward of an autocast op runs in the dtype its forward chose,
  so backward inside the context computes the same gradients). fp32 is a no-op.
* fp16 only: a **loss scaler**. fp16's range ends at 65504, so small gradients underflow
  to zero unless the loss is scaled up first. The scaling is a gradient hook on the
  prepared model's outputs (``attach_output_scaling``): multiplying d(loss)/d(output) by
  S is multiplying the loss by S, and an unchanged custom loop's plain
  ``loss.backward()`` gets it too. ``ScaledOptimizer.step`` unscales the gradients,
  checks them for inf/NaN, and **all-reduces that verdict** (MAX) over the process
  group before deciding: every replica skips the same steps, so none diverges, even
  where gradients differ between replicas (a custom loop without DDP, central-storage's
  per-replica gradients). On overflow the scale halves; after ``growth_interval``
  clean steps it doubles, as ``torch.amp.GradScaler`` does, and its ``state_dict`` has
  GradScaler's keys so tools that read one read the other.

Why not ``torch.amp.GradScaler`` itself: its overflow verdict is per process (found_inf
lives in a private per-optimizer dict), and agreeing across replicas would mean
reaching into it.
"""

from __future__ import annotations

import sys
import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["PRECISION_DTYPES", "autocast", "LossScaler", "ScaledOptimizer", "attach_output_scaling"]

PRECISION_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The autocast context of ``precision`` on ``device`` (a no-op for fp32)."""
    dtype = PRECISION_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class LossScaler:
    """A dynamic loss scale whose overflow verdict is the same on every replica.

    ``agree(found)`` reduces a local verdict (a one-element float tensor, >0 means
    overflow) to the job's; it is an all-reduce MAX under a process group.
    ``on_skip(scale)`` is told of each skipped step, with the new scale.
    """

    def __init__(self, agree: Callable[[torch.Tensor], torch.Tensor],
                 on_skip: Callable[[float], None] = lambda scale: None, *, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self._agree = agree
        self._on_skip = on_skip
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._growth_tracker = 0

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; True when any replica saw inf or NaN."""
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=found.device)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        dtensor = _dtensor_type()
        for g in grads:
            g = g.to_local() if dtensor is not None and isinstance(g, dtensor) else g  # a shard's gradient: its rows
            groups[(g.device, g.dtype)].append(g)
        for (device, _), group in groups.items():
            found_here = torch.zeros(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_here, inv.to(device))
            found += found_here.to(found.device)
        return bool(self._agree(found).item() > 0)

    def update(self, overflow: bool) -> None:
        """After each step: back off on overflow, grow after ``growth_interval`` clean steps."""
        if overflow:
            self.scale *= self.backoff_factor
            self._growth_tracker = 0
            self._on_skip(self.scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self._growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys, so a checkpoint's ``scaler`` reads the same either way."""
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self._growth_tracker = int(state.get("_growth_tracker", 0))


class ScaledOptimizer:
    """Stands in for the prepared optimizer under fp16: unscale, agree, then step or skip."""

    def __init__(self, inner: Any, params: list[nn.Parameter], scaler: LossScaler) -> None:
        self._inner = inner
        self._params = params
        self.scaler = scaler

    @property
    def inner(self) -> Any:
        """The optimizer that steps (what checkpoints hold the state of)."""
        return self._inner

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise TypeError("--precision fp16: optimizer.step(closure) is not supported under loss scaling")
        grads = [p.grad for p in self._params if p.grad is not None]
        overflow = self.scaler.unscale_and_check(grads)
        if not overflow:
            self._inner.step()
        self.scaler.update(overflow)

    def __getattr__(self, name: str) -> Any:  # param_groups, state, state_dict, ...: the inner optimizer's
        return getattr(self._inner, name)


def attach_output_scaling(model: nn.Module, scaler: LossScaler) -> None:
    """Scale every gradient that flows back into ``model``'s outputs by the current scale."""

    def scale_grad(grad: torch.Tensor) -> torch.Tensor:
        return grad * scaler.scale

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for tensor in _tensors(output):
            if tensor.requires_grad and torch.is_grad_enabled():
                tensor.register_hook(scale_grad)

    model.register_forward_hook(hook)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def all_reduce_max(process_group_ready: Callable[[], bool], device: Callable[[], torch.device]
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``agree`` for LossScaler: MAX over the job's process group, or the value itself alone."""

    def agree(found: torch.Tensor) -> torch.Tensor:
        if not process_group_ready():
            return found
        verdict = found.to(device())
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        return verdict

    return agree


def _dtensor_type() -> type | None:
    """torch's DTensor if anything imported it (sharded, --tp): a job that never did holds none, and
    importing it costs a rank about 0.6 s."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)
