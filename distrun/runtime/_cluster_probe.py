"""``--strategy auto`` on a cluster: the probe job's ranks measure instead of training.

The job is the recipe shipped like any other, as multi-worker over every worker host and slot
the real job will get, so what it measures is what that job will meet: the model on each host's
real device, with the threads a rank gets; the memory each rank may use there; and the links, in
the job's own process group: an all-reduce over every rank (the ring a multi-worker job's
gradients and a pipeline's hops take between hosts) and, where a host has several ranks, one
among the ranks of each host (its loopback or NVLink). Rank 0 prints the figures as one line
that starts with ``PLAN_PROBE_MARK``; the client reads it from the job's output (client/_cluster_plan.py).
"""

from __future__ import annotations

import json
import os
from types import ModuleType
from typing import Any

import psutil
import torch
import torch.distributed as dist

from distrun.config import PLAN_PROBE_MARK, JobSpec, PlanProbeSpec
from distrun.planner.memory import cgroup_of, rank_budget_bytes
from distrun.planner.overheads import collective_rates
from distrun.runtime._probe_recipe import MAX_COLLECTIVE_BYTES, collective_device, measure_recipe

__all__ = ["probe_in_job"]


def _budget_bytes(device: torch.device, ranks_per_host: int) -> tuple[int, str]:
    """The smallest rank's budget over the job: a GPU's free memory, else its host's available
    memory (and its memory cgroup's room) shared by the host's ranks, each counted with what it
    holds already. Every rank says its own; the source said is this rank's."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        mine, source = int(torch.cuda.mem_get_info(device)[0]), "GPU free memory"
    else:  # the host's available memory, and its memory cgroup's room where it has a limit
        mine, source = rank_budget_bytes(ranks_per_host, psutil.Process().memory_info().rss,
                                         cgroup_of(os.getpid()), psutil.virtual_memory().available)
        source += " (the tightest rank's)"
    smallest = torch.tensor([mine], dtype=torch.int64, device=collective_device(device))
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest.item()), source


def _within_host(profile_bytes: int, probe: PlanProbeSpec, device: torch.device) -> dict[str, float] | None:
    """The collectives' rates among the ranks of one host (the first host's, as every host is laid out
    alike); None where a host has one rank."""
    if probe.ranks_per_host < 2:
        return None
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(host * probe.ranks_per_host, (host + 1) * probe.ranks_per_host)))
              for host in range(probe.hosts)]  # every rank makes every group, in order
    mine = groups[rank // probe.ranks_per_host]
    rates = collective_rates(min(profile_bytes, MAX_COLLECTIVE_BYTES), mine, collective_device(device))
    dist.barrier()
    return rates


def probe_in_job(recipe: ModuleType, spec: JobSpec, device: torch.device, probe: PlanProbeSpec) -> dict[str, Any]:
    """Measure on every rank of this job; rank 0 prints the figures (and every rank returns them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = spec.training.global_batch_size or 32 * world
    budget, source = _budget_bytes(device, probe.ranks_per_host)
    request = {"global_batch_size": batch, "rows": max(1, batch // world), "seed": spec.training.seed,
               "memory_cap_bytes": budget if device.type != "cuda" else None}
    measured = measure_recipe(recipe, request, rank, world, device)
    within = _within_host(measured["profile"]["gradient_bytes"], probe, device)
    between = measured["link"] if probe.hosts > 1 else None
    reply = {
        "profile": measured["profile"], "overheads": measured["overheads"], "budget_bytes": budget,
        "budget_source": source, "hosts": probe.hosts, "ranks_per_host": probe.ranks_per_host,
        # One host: the job's group is the host's. Several: the whole group's ring is the between-hosts
        # link, and the host's own group (if any) the within; its gather and scatter rates are the host's.
        "within_host": (measured["link"] if probe.hosts == 1 else
                        {"bytes_per_s": within["bytes_per_s"], "latency_s": within["latency_s"]} if within else None),
        "between_hosts": between,
    }
    if probe.hosts > 1:
        for name in ("gather_bytes_per_s", "scatter_bytes_per_s"):
            reply["overheads"][name] = within[name] if within else 0.0
    if rank == 0:
        print(PLAN_PROBE_MARK + json.dumps(reply), flush=True)
    return reply
