"""Distribution strategies for PyTorch, after TensorFlow's tf.distribute.

Recipes receive a strategy; they do not construct one. ``make_strategy`` is
how the runtime builds the one a job asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

from distrun.strategies.data.context import InputContext
from distrun.strategies.data.plan import DistributedDataset, GlobalBatchPlan, Share
from distrun.strategies.elastic.replica import MembershipSwitch
from distrun.strategies.base import REDUCE_OPS, ReplicaInfo, Reporter, StepSettings, Strategy
from distrun.strategies.central_storage import CentralStorageStrategy
from distrun.strategies.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from distrun.strategies.diloco import DiLoCoStrategy
from distrun.strategies.mirrored import MirroredStrategy, MultiWorkerMirroredStrategy
from distrun.strategies.one_device import OneDeviceStrategy
from distrun.strategies.parameter_server import ParameterServerStrategy

__all__ = [
    "Strategy",
    "OneDeviceStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "CentralStorageStrategy",
    "ParameterServerStrategy",
    "ShardedStrategy",
    "ModelParallelStrategy",
    "DiLoCoStrategy",
    "InputContext",
    "ReplicaInfo",
    "StepSettings",
    "Reporter",
    "REDUCE_OPS",
    "DistributedDataset",
    "GlobalBatchPlan",
    "Share",
    "make_strategy",
    "MembershipSwitch",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
]

_BY_NAME: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (OneDeviceStrategy, MirroredStrategy, MultiWorkerMirroredStrategy, CentralStorageStrategy,
                ParameterServerStrategy, DiLoCoStrategy)
}

#: Imported when a job uses them: FSDP2, DTensor and torch's pipelining (which imports torch._dynamo)
#: cost a rank about 1.2 s to import, more than torch itself, and most jobs use none of them.
_LAZY = {"ShardedStrategy": "distrun.strategies.sharded", "ModelParallelStrategy": "distrun.strategies.model_parallel"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_strategy(name: str, replica: ReplicaInfo, reporter: Reporter, **options: Any) -> Strategy:
    """``options`` are the strategy's own keyword arguments (sync_batch_norm, store, num_ps, ...);
    ``tp`` or ``pp`` above 1 makes the model-parallel form of ``name`` (mirrored, multi-worker, sharded),
    ``embeddings="ps"`` its hybrid form (mirrored, multi-worker)."""
    if options.get("tp", 1) > 1 or options.get("pp", 1) > 1:
        return __getattr__("ModelParallelStrategy")(replica, reporter, label=name, **options)
    for key in ("tp", "pp", "pp_schedule", "microbatches", "sequence_parallel", "loss_parallel"):
        options.pop(key, None)
    if options.pop("embeddings", "dense") == "ps":  # the hybrid: DDP beside ps tasks' tables (strategies/hybrid.py)
        from distrun.strategies.hybrid import hybrid_of

        return hybrid_of(name)(replica, reporter, **options)
    if name == "sharded":
        return __getattr__("ShardedStrategy")(replica, reporter, **options)
    return _BY_NAME[name](replica, reporter, **options)
