"""MirroredStrategy: one process per device, DistributedDataParallel.

DDP's bucketed all-reduce overlaps with backward, which is why mirrored is the
default choice for synchronous training on one host. Sync batch norm is opt-in
(``--sync-batch-norm``) because it adds a collective per BatchNorm layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distrun.config._compression import DEFAULT_POWERSGD_WARMUP, Compression
from distrun.strategies.communication.allreduce_auto import ddp_bucket_bytes, known_choice, probe, probe_sizes
from distrun.strategies.communication.compression import CommCompression
from distrun.strategies.elastic.replica import ElasticModel
from distrun.strategies.communication.hierarchical import HierarchicalAllReduce
from distrun.strategies.step import sync_batch_norm
from distrun.strategies.step.precision import PRECISION_DTYPES
from distrun.strategies.base import Strategy


class MirroredStrategy(Strategy):
    name = "mirrored"

    def __init__(self, *args: Any, sync_batch_norm: bool = False, compression: Compression = Compression(),
                 powersgd_warmup: int = DEFAULT_POWERSGD_WARMUP, allreduce: str = "flat", **kwargs: Any) -> None:
        """``compression``: what DDP's all-reduce sends; ``allreduce``: flat (DDP's own ring) or
        hierarchical (inside hosts, then across them): docs/communication.md."""
        super().__init__(*args, **kwargs)
        self._sync_batch_norm = sync_batch_norm
        self._allreduce = allreduce
        self._compression = compression
        self._powersgd_warmup = powersgd_warmup
        self._comm: CommCompression | None = None
        self._hierarchical: HierarchicalAllReduce | None = None
        self._holder: ElasticModel | None = None  # --elastic: what prepare returned

    def _wrap(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        model = model.to(self.device)
        if self._sync_batch_norm:
            model = sync_batch_norm.convert(model, self.device)  # torch's on CUDA, ours on CPU
        ddp = self._ddp(model)
        if self._elastic is not None:  # DDP is rebuilt at each new round; the holder stays
            self._holder = ElasticModel(ddp)
            return self._holder, optimizer
        return ddp, optimizer

    def _ddp(self, model: nn.Module) -> DistributedDataParallel:
        """DDP over the current group, with the job's all-reduce and compression hooks."""
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # --elastic, after the first round: a heal from the source follows at once, so DDP's own
        # broadcast of rank 0's parameters would be moved for nothing (5 MB on the benchmark's model).
        healed_next = self._elastic is not None and self._elastic.round is not None and self._elastic.round.generation > 0
        ddp = DistributedDataParallel(model, device_ids=device_ids, init_sync=not healed_next)
        wire = PRECISION_DTYPES.get(self._compression.kind)  # fp16/bf16 on the wire; None: as it is
        if self._allreduce == "auto":
            self._allreduce = self._choose(ddp, wire)
        if self._allreduce == "hierarchical":
            if self._hierarchical is None:
                self._hierarchical = HierarchicalAllReduce(self._nodes(), wire_dtype=wire)
            ddp.register_comm_hook(None, self._hierarchical.hook)
        elif self._compression.active:
            self._comm = CommCompression(self._compression, warmup_steps=self._powersgd_warmup,
                                         seed=self._replica.seed)
            self._comm.attach(ddp)
        return ddp

    def _release_model(self) -> None:
        if self._comm is not None:  # its hook state belongs to the old group
            self._comm.close()
            self._comm = None

    def _rebuild_model(self, round_: Any) -> None:
        """DDP over the new group. Where only members left, the same DDP takes the new group
        (``_update_process_group``: its buckets are rebuilt at the next step, no new DDP).
        A round with a joiner builds a new DDP: the joiner's constructor runs collectives
        (parameter shapes) that every member must run with it. Hooks are attached anew."""
        ddp = self._holder.module
        if min(round_.steps) >= 0 and not self._compression.active:
            ddp._update_process_group(dist.group.WORLD)
            return
        self._holder.module = self._ddp(ddp.module)

    def _choose(self, ddp: DistributedDataParallel, wire: torch.dtype | None) -> str:
        """``--allreduce auto``: flat or hierarchical for this job, the same on every rank, said in an event."""
        nodes = self._nodes()
        choice = known_choice(nodes, backend=str(dist.get_backend()), powersgd=self._compression.kind == "powersgd")
        if choice is None:
            self._hierarchical = HierarchicalAllReduce(nodes, wire_dtype=wire)
            per_host = max(nodes.count(node) for node in set(nodes))
            choice = probe(probe_sizes(ddp_bucket_bytes(ddp)), flat=dist.all_reduce,
                           hierarchical=self._hierarchical.all_reduce_mean, dtype=wire or torch.float32,
                           device=self._collective_device, hosts=len(set(nodes)), slots=per_host)
            if choice.algorithm != "hierarchical":
                self._hierarchical.close()
                self._hierarchical = None
        if self.is_chief:
            self._reporter.allreduce_chosen(choice)
        return choice.algorithm

    def _nodes(self) -> list[int]:
        """Every rank's host (its node rank), gathered: the groups of a hierarchical all-reduce."""
        mine = torch.tensor([self._replica.node_rank], device=self._collective_device)
        every = [torch.zeros_like(mine) for _ in range(self.num_replicas)]
        dist.all_gather(every, mine)
        return [int(t.item()) for t in every]

    def close(self) -> None:
        if self._hierarchical is not None:
            self._hierarchical.close()
        if self._comm is not None:
            self._comm.close()
        super().close()

    def _comm_state(self) -> dict[str, Any] | None:
        return self._comm.state_for_checkpoint(self.replica_id, self.num_replicas) if self._comm else None

    def _load_comm_state(self, saved: dict[str, Any] | None) -> None:
        if self._comm is not None:
            self._comm.load_checkpoint_state(saved, self.replica_id)


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """Many hosts, the same model as mirrored (TF's MultiWorkerMirroredStrategy).

    DDP already all-reduces across every process of the group wherever it runs, so
    the difference from mirrored is where the processes are, which the worker
    servers decide; the training step is the same, and so are the parameters.
    """

    name = "multi-worker"
