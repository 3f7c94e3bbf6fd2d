"""``--on-nonfinite stop|skip|warn``: what a NaN or Inf loss does to a fit-style job.

The fit loop asks :meth:`NonFiniteGuard.update_allowed` after ``backward`` and before
``optimizer.step``:

- ``stop`` (the default): a replica whose loss is not finite raises
  :class:`~distrun.errors.NonFiniteLoss`, naming the step and itself. The others fail at
  their next collective, which the launcher reports as a consequence, not the cause.
- ``skip``: every replica puts its verdict in one all-reduce with a slot per replica, so
  all of them skip the same step's update, as the fp16 loss scaler skips an overflowing
  step. The step still counts; the chief logs ``nonfinite_skipped`` and how many replicas
  saw it.
- ``warn``: the update is applied; the replica that saw it logs ``nonfinite_applied``.

Cost: one ``.item()`` of a scalar per step (a device sync on a GPU). Only ``skip``, which
needs every replica to agree, adds an all-reduce of one integer per replica. With the
check, ``bench overhead``'s fit loop measured 0.986x of hand-written DDP (its target is
0.98x).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distrun.errors import NonFiniteLoss
from distrun.strategies import Strategy

__all__ = ["NONFINITE_MODES", "NonFiniteGuard"]

NONFINITE_MODES = ("stop", "skip", "warn")


class NonFiniteGuard:
    def __init__(self, mode: str, strategy: Strategy) -> None:
        self.mode = mode
        self._strategy = strategy

    def update_allowed(self, loss: torch.Tensor) -> bool:
        """Whether this step's update may be applied; raises under ``stop`` if this loss is not finite."""
        strategy = self._strategy
        bad_here = not bool(torch.isfinite(loss.detach()).all())
        step = strategy.step + 1  # the step being taken
        if self.mode != "skip":
            if not bad_here:
                return True
            if self.mode == "stop":
                raise NonFiniteLoss(f"the loss is {_what(loss)} (--on-nonfinite stop; skip drops such steps on "
                                    "every replica, warn goes on)")
            strategy._reporter.log(step, {"nonfinite_applied": 1.0})  # warn: from the replica that saw it
            return True
        bad = self._replicas_with(bad_here)
        if bad and strategy.is_chief:  # said once, at the step being taken (as the fp16 scaler says a skipped step)
            strategy._reporter.log(step, {"nonfinite_skipped": 1.0, "nonfinite_replicas": float(len(bad))})
        return not bad

    def _replicas_with(self, flag: bool) -> list[int]:
        """The replicas whose ``flag`` is set (one all-reduce of a slot per replica)."""
        strategy = self._strategy
        if not (dist.is_available() and dist.is_initialized()):
            return [strategy.replica_id] if flag else []
        device = strategy.device if dist.get_backend() == "nccl" else torch.device("cpu")
        slots = torch.zeros(strategy.num_replicas, dtype=torch.int32, device=device)
        if flag:
            slots[strategy.replica_id] = 1
        dist.all_reduce(slots, op=dist.ReduceOp.MAX)
        return [index for index, value in enumerate(slots.tolist()) if value]


def _what(loss: torch.Tensor) -> str:
    return "nan" if bool(torch.isnan(loss.detach()).any()) else "inf"
