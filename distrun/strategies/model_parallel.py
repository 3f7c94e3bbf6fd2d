"""Model parallel (``--tp N``): each replica's layers split over N ranks, replicas mirrored or sharded.

``--strategy mirrored --tp 2 --replicas 2`` runs 4 ranks: two replicas, each of two ranks that
split every planned layer (``parallel/plan.py``). The data-parallel dimension is FSDP2's, as in
torchtitan: the tensor-parallel model's blocks are ``fully_shard``-ed over the mesh's
``(dp_replicate, dp_shard)`` slice. Mirrored replicates over every data-parallel rank (a
shard dimension of 1: HSDP with nothing to shard, gradients all-reduced), sharded shards over
them (``--shard-within host``: HSDP inside each host). DDP is not used: it cannot hold
DTensor parameters, and FSDP2 over a slice of the same mesh is what composes with tensor
parallel (``parallel/mesh.py``).

The order is torchtitan's: the model is built on the meta device on every rank but 0 (rank 0
builds it on the CPU for the seeded initial values, then drops it to meta too), tensor parallel
splits it, activation checkpointing wraps each block (``Strategy.prepare``), ``--compile``
compiles each block, FSDP2 shards the blocks and the root, each rank allocates its pieces, and
rank 0's initial values are broadcast into them. So every rank starts from one-device's
parameters, and after each step holds its pieces of one-device's parameters.

Everything else is sharded's: checkpoints are DCP folders under the model's own parameter names
(any layout reads them: one-device, mirrored, sharded at any rank count, another --tp), the
optimizer is rebuilt on the pieces, ``--precision`` is FSDP's mixed-precision policy.
A replica is several ranks, so ``num_replicas`` and ``replica_id`` count replicas, each rank of a
replica reads the same batches, and ``reduce``/``gather`` run over one rank per replica.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from distrun.strategies.parallel.mesh import MeshShape, ParallelMesh, mesh_shape
from distrun.strategies.parallel.plan import resolve_plan
from distrun.strategies.parallel.tensor import apply_tensor_parallel
from distrun.strategies.sharded import ShardedStrategy, _on_cpu, _on_meta
from distrun.strategies.sharding.apply import apply_fsdp, parameter_names, rebuild_optimizer
from distrun.strategies.sharding.compile import compile_units
from distrun.strategies.sharding.state import broadcast_from_rank0
from distrun.strategies.sharding.units import pick_units
from distrun.strategies.step.precision import PRECISION_DTYPES

__all__ = ["ModelParallelStrategy"]

# The replicated modules' outputs leave as ``to_local()`` views (parallel/tensor.py), which FSDP2
# warns about at the root in case a recipe writes into its output in place; the loss never does.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
# --clip-grad-norm's norm of the gradients on the 4-D mesh reduces over two dimensions in two
# all-reduces (a few floats each); DTensor says so on every step.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


class ModelParallelStrategy(ShardedStrategy):
    """``label``: the --strategy it runs under (mirrored, multi-worker, sharded): what the live
    view, the summary and the checkpoints call it."""

    def __init__(self, *args: Any, tp: int, label: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.name = label
        self.shape: MeshShape = mesh_shape(self._replica.world_size, tp=tp, sharded=label == "sharded",
                                           shard_within=self._shard_within, hosts=self._hosts)
        self.parallel = ParallelMesh(self.shape, self.device.type)
        self.place = self.shape.place(self._replica.rank)
        self._replica_group = self.parallel.replica_group
        #: The recipe's ``tp_plan(model)``, when it defines one (the runtime sets it).
        self.tp_plan_from: Any = None

    @property
    def num_replicas(self) -> int:
        return self.shape.dp

    @property
    def replica_id(self) -> int:
        return self.place["dp"]

    def _wrap(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        initial = _on_cpu(model.state_dict()) if self.is_chief else {}  # rank 0's values, for everyone
        names = parameter_names(model)
        plan = resolve_plan(model, self.tp_plan_from, self.shape.tp)
        units = pick_units(model, self.units_from)
        if self.is_chief:
            print(f"[{self.name}] mesh {self.shape.describe()}; {plan.description}; FSDP2 units: {units.description}",
                  flush=True)
        if not _on_meta(model):  # rank 0's copy: its values are in ``initial``, the pieces come from there
            model.to(torch.device("meta"))
        apply_tensor_parallel(model, plan, self.parallel.tp)
        if self._step.settings.compile:
            compile_units(units.modules, self._step.settings.compile_mode)
        apply_fsdp(model, units.modules, self.parallel.data_parallel, param_dtype=PRECISION_DTYPES.get(self.precision),
                   reshard_after_forward=self._reshard, offload=self._offload)
        model.to_empty(device=torch.device("cpu") if self._offload else self.device)
        broadcast_from_rank0(model, initial, self._collective_device)
        del initial
        return model, rebuild_optimizer(optimizer, model, names) if optimizer is not None else None

    def _on_batch(self, samples: int, weight: float) -> None:
        """Every rank of a replica reads its batch: each reports its share, so the job counts it once."""
        super()._on_batch(samples / self.shape.per_replica, weight)  # type: ignore[arg-type]

    def _checkpoint_meta(self) -> dict[str, Any]:
        return {**super()._checkpoint_meta(), "mesh": {"dp": self.shape.dp, "tp": self.shape.tp}}
