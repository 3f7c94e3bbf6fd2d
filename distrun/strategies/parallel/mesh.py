"""Where a rank sits in a model-parallel job: one DeviceMesh, torchtitan's order.

The job's ranks form a grid ``(pp, dp_replicate, dp_shard, tp)``, tensor parallel innermost.
Consecutive ranks are the ones a launcher puts on one host, so a tensor-parallel group (a
collective inside every layer, forward and backward) stays on a host's fast links, and the
data-parallel dimensions span hosts, as torchtitan lays its mesh out. Data parallelism is
split in two the way FSDP2's HSDP wants it: ``dp_replicate`` ranks hold whole copies of their
shards (mirrored: all of the data-parallel ranks), ``dp_shard`` ranks shard them (sharded).

One root mesh holds every dimension, size 1 or not, so every parameter is a DTensor of the
same root: FSDP2 over ``(dp_replicate, dp_shard)`` composes with the ``tp`` slice, and the
gradient clip and the optimizers see one kind of tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distrun.errors import ConfigError
from distrun.protocol import mesh_place

__all__ = ["MESH_DIMS", "MeshShape", "ParallelMesh", "mesh_shape"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class MeshShape:
    """The degree of each dimension; their product is the job's ranks."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        """The data-parallel degree: how many replicas read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def ranks(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def per_replica(self) -> int:
        return self.pp * self.tp

    def place(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s coordinate on each dimension, and ``dp`` (its replica)."""
        place = mesh_place(rank, {"dp": self.dp, "tp": self.tp, "pp": self.pp})  # the live view's formula
        return {**place, "dp_replicate": place["dp"] // self.dp_shard, "dp_shard": place["dp"] % self.dp_shard}

    def describe(self) -> str:
        """``dp 2 x tp 2``, and how the data-parallel ranks hold the state."""
        text = f"dp {self.dp} x tp {self.tp}" + (f" x pp {self.pp}" if self.pp > 1 else "")
        if self.dp > 1:
            if self.dp_shard == 1:
                text += " (dp replicated)"
            elif self.dp_replicate == 1:
                text += " (dp sharded)"
            else:
                text += f" (dp sharded over {self.dp_shard}, replicated over {self.dp_replicate})"
        return text


def mesh_shape(world: int, *, tp: int, sharded: bool, shard_within: str, hosts: int, pp: int = 1) -> MeshShape:
    """The mesh for ``world`` ranks on ``hosts`` hosts (in rank order, equally many each).

    ``sharded``: the data-parallel ranks shard the state (``--strategy sharded``), over all of
    them, or with ``shard_within == "host"`` only over those on one host (HSDP). ``auto`` shards
    over all of them: under --tp/--pp the per-host choice sharded makes alone does not apply.
    """
    if world % (tp * pp):
        raise ConfigError(f"--tp {tp} --pp {pp}: the job's {world} rank(s) do not split into replicas of {tp * pp}")
    if hosts > 1 and world % hosts == 0 and (world // hosts) % tp:
        raise ConfigError(f"--tp {tp}: a tensor-parallel group stays inside one host, and each host runs "
                          f"{world // hosts} rank(s); give every host a multiple of {tp} slots")
    dp = world // (tp * pp)
    if not sharded:
        return MeshShape(pp=pp, dp_replicate=dp, tp=tp)
    if shard_within != "host" or hosts < 2:
        return MeshShape(pp=pp, dp_shard=dp, tp=tp)
    if world % hosts:
        raise ConfigError(f"--shard-within host: {world} ranks do not split evenly over {hosts} hosts")
    inside = min(dp, max(1, world // hosts // tp))
    if dp % inside:
        raise ConfigError(f"--shard-within host: {dp} replicas do not split into groups of the {inside} on a host")
    return MeshShape(pp=pp, dp_replicate=dp // inside, dp_shard=inside, tp=tp)


class ParallelMesh:
    """The job's meshes, built together on every rank (each is a collective).

    ``root``: the 4-D mesh FSDP2 and tensor parallel use. ``place``: the same ranks as
    ``(pp, dp, tp)``, whose ``dp`` group is the replicas' own (what ``strategy.reduce`` and
    ``gather`` sum over: every rank of a replica holds the same loss, counted once).
    """

    def __init__(self, shape: MeshShape, device_type: str) -> None:
        if shape.ranks != dist.get_world_size():
            raise ConfigError(f"the mesh {shape.describe()} has {shape.ranks} rank(s), the job "
                              f"{dist.get_world_size()}")
        self.shape = shape
        self.root: DeviceMesh = init_device_mesh(
            device_type, (shape.pp, shape.dp_replicate, shape.dp_shard, shape.tp), mesh_dim_names=MESH_DIMS)
        self.place: DeviceMesh = init_device_mesh(device_type, (shape.pp, shape.dp, shape.tp),
                                                  mesh_dim_names=("pp", "dp", "tp"))

    @property
    def tp(self) -> DeviceMesh:
        return self.root["tp"]

    @property
    def pipeline_group(self) -> dist.ProcessGroup:
        """This rank's pipeline: the ranks of its replica at its tensor-parallel place, one per stage."""
        return self.root.get_group("pp")

    @property
    def data_parallel(self) -> DeviceMesh:
        """FSDP2's mesh: replicate over the first dimension, shard over the second."""
        return self.root["dp_replicate", "dp_shard"]

    @property
    def replica_group(self) -> dist.ProcessGroup:
        return self.place.get_group("dp")
