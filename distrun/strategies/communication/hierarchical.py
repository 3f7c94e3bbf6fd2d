"""Hierarchical all-reduce as a DDP communication hook (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE).

A flat ring all-reduce sends each byte across host links 2(n-1)/n times for n
ranks, whichever ranks share a host. Hierarchically, each bucket is

1. reduced inside each host onto its leader (the host's lowest rank),
2. all-reduced across the leaders only (one rank per host on the slow links),
3. broadcast from the leader to the host's other ranks,

so the host links carry the ring of h hosts, not of n ranks: with s slots per
host that is 2(h-1)/h of a bucket per host link instead of the flat ring's
s x 2(n-1)/n (bandwidth arithmetic, docs/communication.md).

Ordering: collectives on one process group must be issued in the same order on
every rank. DDP hands buckets over in index order on every rank, and one
background thread per replica runs each bucket's three steps in that order
(``_bucket_queue.py``), so the order holds, and backward keeps computing while
the thread communicates, as with DDP's own all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distrun.strategies.communication.bucket_queue import OrderedBucketHook

__all__ = ["CHUNK_BYTES", "HierarchicalAllReduce", "host_groups"]

#: Pipeline unit of a bucket's three steps (a 25 MB DDP bucket crosses as 25 chunks). 1 MB
#: gave 1.15x over flat from 4 MB messages up on 4 hosts x 2 at 200 Mbit/s; 4 MB chunks, 1.05x at 4 MB.
CHUNK_BYTES = 1 * 2**20


def host_groups(node_of_rank: list[int]) -> list[list[int]]:
    """Ranks per host, hosts in order of their lowest rank (each list sorted)."""
    hosts: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        hosts.setdefault(node, []).append(rank)
    return sorted(hosts.values(), key=lambda ranks: ranks[0])


class HierarchicalAllReduce:
    """The hook and its process groups; every rank of the job must construct one (new_group)."""

    def __init__(self, node_of_rank: list[int], *, wire_dtype: torch.dtype | None = None) -> None:
        """``node_of_rank[r]``: the host of rank r. ``wire_dtype``: cast each bucket to it
        for the three steps (``--compression fp16|bf16``); None sends it as it is."""
        rank = dist.get_rank()
        groups = host_groups(node_of_rank)
        self.world_size = len(node_of_rank)
        self.hosts = len(groups)
        self._wire_dtype = wire_dtype
        self._intra: Any = None
        for ranks in groups:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if rank in ranks:
                self._intra, self.leader, self._local_size = group, ranks[0], len(ranks)
        leaders = [ranks[0] for ranks in groups]
        self._inter = dist.new_group(leaders)
        self.is_leader = rank == self.leader
        self._ordered = OrderedBucketHook(lambda bucket: self.all_reduce_mean(bucket.buffer()), "distrun-hierarchical")
        self.hook = self._ordered.hook

    def all_reduce_mean(self, buffer: torch.Tensor) -> torch.Tensor:
        """One bucket's three steps, now, on the calling thread (the hook's thread, or auto's probe).

        Pipelined in chunks of :data:`CHUNK_BYTES`: while the leaders all-reduce chunk k
        across hosts, chunk k+1 is still being reduced inside the host, and chunk k is
        broadcast while k+1 crosses. Unpipelined, the two steps inside the host added
        their whole time to the slow links' (1.07-1.10x over flat on 4 hosts x 2 at
        200 Mbit/s, against 1.17x from bandwidth arithmetic; pipelined, 1.15-1.16x).
        """
        wire = buffer.to(self._wire_dtype) if self._wire_dtype is not None else buffer
        wire.div_(self.world_size)  # before summing: a reduced dtype must not overflow
        chunks = wire.split(max(1, CHUNK_BYTES // wire.element_size()))
        local, across = self._local_size > 1, self.is_leader and self.hosts > 1
        reduced = [dist.reduce(c, dst=self.leader, group=self._intra, async_op=True) for c in chunks] if local else []
        crossed = []
        for index, chunk in enumerate(chunks):
            if local:
                reduced[index].wait()
            if across:
                crossed.append(dist.all_reduce(chunk, group=self._inter, async_op=True))
        if local:
            sent = []
            for index, chunk in enumerate(chunks):
                if across:
                    crossed[index].wait()
                sent.append(dist.broadcast(chunk, src=self.leader, group=self._intra, async_op=True))
            for work in sent:
                work.wait()
        else:
            for work in crossed:
                work.wait()
        if wire is not buffer:
            buffer.copy_(wire)
        return buffer

    def close(self) -> None:
        self._ordered.close()
