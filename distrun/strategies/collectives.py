"""A replica's collectives: ``reduce``, ``gather`` and ``barrier`` of the Strategy API.

They run over the group of one rank per replica's share (``_replica_group``; None: every
rank), so a value every rank of a model-parallel replica holds is counted once, and on the
device the backend reduces on (a CPU tensor for gloo, the rank's GPU for NCCL).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distrun.errors import ConfigError

__all__ = ["REDUCE_OPS", "ReplicaCollectives"]

REDUCE_OPS = ("sum", "mean", "max", "min")


class ReplicaCollectives:
    """Mixed into Strategy, which supplies ``num_replicas``, ``device`` and ``_replica_group``."""

    _replica_group: Any = None

    def reduce(self, op: str, value: torch.Tensor | float) -> torch.Tensor | float:
        """All-reduce ``value`` over replicas with ``op`` in sum|mean|max|min."""
        if op not in REDUCE_OPS:
            raise ConfigError(f"strategy.reduce: op must be one of {', '.join(REDUCE_OPS)}. Received: {op!r}")
        as_float = not isinstance(value, torch.Tensor)
        tensor = torch.tensor(float(value), dtype=torch.float64) if as_float else value.detach().clone()
        if self._distributed:
            tensor = tensor.to(self._collective_device)
            dist_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
            dist.all_reduce(tensor, op=dist_op, group=self._replica_group)
            if op == "mean":
                tensor = tensor / self.num_replicas
        return float(tensor.item()) if as_float else tensor

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        """Concatenate every replica's ``value`` along dim 0 (first dims may differ)."""
        return self._gather(value, self._replica_group)

    def _gather(self, value: torch.Tensor, group: Any) -> torch.Tensor:
        """``gather`` over ``group`` (None: every rank)."""
        if not self._distributed:
            return value.detach().clone()
        value = value.detach().to(self._collective_device)
        if value.dim() == 0:
            value = value.reshape(1)
        members = dist.get_world_size(group)
        size = torch.tensor([value.shape[0]], device=self._collective_device)
        sizes = [torch.zeros_like(size) for _ in range(members)]
        dist.all_gather(sizes, size, group=group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros((longest, *value.shape[1:]), dtype=value.dtype, device=value.device)
        padded[: value.shape[0]] = value
        parts = [torch.empty_like(padded) for _ in range(members)]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])

    def barrier(self) -> None:
        if self._distributed:
            dist.barrier()

    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _any_true(self, flag: bool) -> bool:
        if not self._distributed:
            return flag
        t = torch.tensor([1 if flag else 0], device=self._collective_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())
