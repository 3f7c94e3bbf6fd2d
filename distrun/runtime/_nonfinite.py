"""``--on-nonfinite stop|skip|warn``: what a NaN or Inf loss does to a fit-style job.

The fit loop asks :meth:`NonFiniteGuard.update_allowed` after ``backward`` and before
``optimizer.step``. Every replica puts its own verdict (is my loss finite?) in one
all-reduce of a vector with a slot per replica, so they all know the same thing at the
same step, and which replicas saw it:

- ``stop`` (the default): the replicas whose loss was not finite raise
  :class:`~distrun.errors.NonFiniteLoss`, naming the step and themselves; the others wait
  to be stopped (the launcher stops every rank when one fails), so the job's error is the
  one that names the cause.
- ``skip``: no replica applies this step's update, as the fp16 loss scaler skips an
  overflowing step; the step still counts, and is said as a ``nonfinite_skipped`` log.
- ``warn``: the update is applied; the chief says so once per step, as a log.

Cost: one ``.item()`` of a small tensor per step, so one device sync on a GPU, and a
one-element-per-replica all-reduce. Without it, a NaN would surface only as a loss
column of "nan" until the parameters are all NaN.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from distrun.errors import NonFiniteLoss
from distrun.strategies import Strategy

__all__ = ["NONFINITE_MODES", "NonFiniteGuard"]

NONFINITE_MODES = ("stop", "skip", "warn")
#: How long a replica whose loss was finite waits for the job to stop (another replica raised).
_WAIT_FOR_STOP_S = 60.0


class NonFiniteGuard:
    def __init__(self, mode: str, strategy: Strategy) -> None:
        self.mode = mode
        self._strategy = strategy

    def update_allowed(self, loss: torch.Tensor) -> bool:
        """Whether this step's update may be applied; raises under ``stop`` if a loss was not finite."""
        strategy = self._strategy
        bad_here = not bool(torch.isfinite(loss.detach()).all())
        bad = self._replicas_with(bad_here)
        if not bad:
            return True
        step = strategy.step + 1  # the step being taken
        value = "nan" if math.isnan(float(loss.detach().float().sum())) else "inf" if bad_here else "not finite"
        if self.mode == "stop":
            if bad_here:
                raise NonFiniteLoss(f"the loss is {value} (--on-nonfinite stop; skip drops such steps on every "
                                    f"replica, warn goes on)")
            time.sleep(_WAIT_FOR_STOP_S)  # the launcher stops us once a replica that saw it has failed
            raise NonFiniteLoss(f"the loss of replica(s) {', '.join(map(str, bad))} was not finite at step {step}")
        if strategy.is_chief:  # said once, at the step being taken (as the fp16 scaler says a skipped step)
            strategy._reporter.log(step, {f"nonfinite_{'skipped' if self.mode == 'skip' else 'applied'}": 1.0,
                                          "nonfinite_replicas": float(len(bad))})
        return self.mode == "warn"

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
