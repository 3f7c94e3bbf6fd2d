"""distrun's own step, whatever the model: its fit loop timed on a one-layer model in the probe.

A small model's step is mostly what the loop does around the model: the data plan's batch, the
strategy's ``run`` (its clock, its reporter), DDP's hooks and all-reduce call, the non-finite
guard, the optimizer. The planner cannot guess that from the model; here the probe's processes
run the real :func:`distrun.runtime._fit.fit` under mirrored (one-device for a probe of one
process) on a one-layer model for two step counts, and the difference over the extra steps is
the loop's cost a step (the setup both runs pay cancels out).
"""

from __future__ import annotations

import time
from types import ModuleType

import torch
from torch import nn
from torch.utils.data import TensorDataset

from distrun.config import JobSpec, StrategyName
from distrun.runtime._fit import fit
from distrun.runtime._process import EventWriter
from distrun.runtime._reporter import EventReporter
from distrun.strategies import ReplicaInfo, StepSettings, make_strategy

__all__ = ["loop_step_s"]

_FEW, _MANY = 3, 13
_WIDTH = 4


def _recipe() -> ModuleType:
    recipe = ModuleType("distrun_loop_probe")
    recipe.model = lambda: nn.Linear(_WIDTH, _WIDTH)  # type: ignore[attr-defined]
    recipe.optimizer = lambda params: torch.optim.SGD(params, lr=0.0)  # type: ignore[attr-defined]
    recipe.loss = lambda outputs, batch: outputs.pow(2).mean()  # type: ignore[attr-defined]
    recipe.train_data = lambda ctx: TensorDataset(torch.zeros(4096, _WIDTH))  # type: ignore[attr-defined]
    return recipe


def _run(steps: int, rank: int, ranks: int, device: torch.device) -> float:
    name = StrategyName.MIRRORED if ranks > 1 else StrategyName.ONE_DEVICE
    spec = JobSpec.of("/distrun-loop-probe.py", strategy=name, replicas=ranks, steps=steps,
                      global_batch_size=8 * ranks, device=device.type)
    reporter = EventReporter(EventWriter(None), rank, ranks, 3600.0, device.type)
    replica = ReplicaInfo(rank=rank, world_size=ranks, local_rank=rank if device.type == "cpu" else 0,
                          device=device, seed=0)
    strategy = make_strategy(name.value, replica, reporter, step=StepSettings())
    start = time.perf_counter()
    fit(_recipe(), strategy, spec, reporter, lambda *args: None)
    return time.perf_counter() - start


def loop_step_s(rank: int, ranks: int, device: torch.device) -> float:
    """distrun's fit loop's cost a step on this backend and these ranks (seconds)."""
    _run(_FEW, rank, ranks, device)  # the first run pays for what is built once (DDP's buckets, imports)
    few = _run(_FEW, rank, ranks, device)
    many = _run(_MANY, rank, ranks, device)
    return max(0.0, (many - few) / (_MANY - _FEW))
