"""``--strategy auto`` on a cluster: the probe job's ranks measure instead of training.

The job is the recipe shipped like any other, as multi-worker over every worker host and slot
the real job will get, so what it measures is what that job will meet: the model on each host's
real device, with the threads a rank gets; the memory each rank may use there; and the links, in
the job's own process group: an all-reduce over every rank (the ring a multi-worker job's
gradients and a pipeline's hops take between hosts) and, where a host has several ranks, one
among the ranks of each host (its loopback or NVLink). Rank 0 prints the figures as one line
that starts with ``PLAN_PROBE_MARK``; the client reads it from the job's output (client/_cluster_plan.py).

The links are the slow part to time over a slow network (three collectives on the gradients' size,
several times each), and they change far less often than the model. So the client keeps each
cluster's for a day (client/_link_cache.py) and sends them with the probe; its ranks then time one
all-reduce of a megabyte instead, and time everything again only where that lands more than
:data:`KEPT_HOLDS` times away from what the kept figures predict (a link shaped, swapped, moved).
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
from distrun.planner.overheads import all_reduce_s, collective_rates
from distrun.runtime._probe_recipe import MAX_COLLECTIVE_BYTES, collective_device, measure_recipe

__all__ = ["probe_in_job"]


def _budget_bytes(device: torch.device, ranks_per_host: int) -> tuple[int, str, int]:
    """The smallest rank's budget over the job: a GPU's free memory, else its host's available
    memory (and its memory cgroup's room) shared by the host's ranks, each counted with what it
    holds already. Every rank says its own; the source said is this rank's. Third, on GPUs, the
    smallest rank's share of its host's memory (``--offload cpu`` keeps its shards there; 0 on CPU)."""
    host, source = rank_budget_bytes(ranks_per_host, psutil.Process().memory_info().rss,
                                     cgroup_of(os.getpid()), psutil.virtual_memory().available)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        mine, source = int(torch.cuda.mem_get_info(device)[0]), "GPU free memory"
    else:  # the host's available memory, and its memory cgroup's room where it has a limit
        mine, host, source = host, 0, source + " (the tightest rank's)"
    smallest = torch.tensor([mine, host], dtype=torch.int64, device=collective_device(device))
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest[0].item()), source, int(smallest[1].item())


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


#: A kept link holds while one all-reduce of this many bytes (or the gradients', if fewer) takes
#: within :data:`KEPT_HOLDS` of what the kept figures say it takes. Small on purpose: on a link that
#: slowed, the check is traffic too, and the links are timed right after it (after an 8 MB check on
#: the lab's link shaped to 100 Mbit/s, the pipeline's step came out at 0.74 s once instead of about
#: 0.2, and once the pipeline lost to multi-worker: the timing after a burst is not the link's).
CHECK_BYTES = 1 << 20
#: How far (either way) the check may land from the kept figures' prediction: gloo's small
#: all-reduces wander by tens of percent on a loaded host, a link shaped or swapped moves by far more.
KEPT_HOLDS = 3.0
#: What a check's time may carry beyond the link's on a busy host (a wake-up, a context switch): it is
#: added to both the check's time and the kept figures' prediction before they are compared, so a
#: fast link's millisecond is not judged by its jitter (on the namespace hosts a 1 MB all-reduce of
#: about 1 ms once took 3.5 times that, and another 0.36 times the prediction). gloo's; NCCL's
#: collectives wander by microseconds, and a link an order faster (InfiniBand's 1 MB in 0.08 ms, or
#: 1.6 ms where NCCL fell back to 10 GbE TCP) must still fail its check when it slows: 50 us there.
CHECK_FLOOR_S = 1e-3
CHECK_FLOOR_CUDA_S = 5e-5
#: Kept figures timed on a message this many times larger or smaller than this model's gradients are
#: timed again: a rate taken on kilobytes is mostly latency, one taken on megabytes is not.
KEPT_SIZE_RANGE = 4.0


def _check_kept(kept: dict[str, Any], nbytes: int, probe: PlanProbeSpec,
                device: torch.device) -> tuple[bool, str]:
    """Whether ``kept`` (a cluster's links from an earlier probe) still hold for this model, and why."""
    if not 1 / KEPT_SIZE_RANGE <= nbytes / max(1, kept["nbytes"]) <= KEPT_SIZE_RANGE:
        return False, f"kept links were timed on {kept['nbytes']:,} bytes, this model's gradients are {nbytes:,}"
    ring = kept["between_hosts"] if probe.hosts > 1 else kept["within_host"]
    if ring is None:
        return False, "the kept links have no ring over these ranks"
    n, check = dist.get_world_size(), min(nbytes, CHECK_BYTES)
    floor = CHECK_FLOOR_CUDA_S if device.type == "cuda" else CHECK_FLOOR_S
    took = torch.tensor([all_reduce_s(check, device=collective_device(device))], device=collective_device(device))
    # One verdict on every rank (the same collectives follow), from the least disturbed rank's median.
    dist.all_reduce(took, op=dist.ReduceOp.MIN)
    expected = check * 2 * (n - 1) / n / ring["bytes_per_s"] + 2 * (n - 1) * ring["latency_s"]
    ratio = (float(took.item()) + floor) / (expected + floor)
    said = f"a {check:,}-byte all-reduce took {ratio:.2g}x what the kept links say (+{floor * 1e3:g} ms)"
    return 1 / KEPT_HOLDS <= ratio <= KEPT_HOLDS, said


def _time_links(nbytes: int, probe: PlanProbeSpec, device: torch.device) -> dict[str, Any]:
    """The collectives timed on this job's ranks, in the kept links' keys."""
    rates = collective_rates(nbytes, device=collective_device(device))
    ring = {"bytes_per_s": rates["bytes_per_s"], "latency_s": rates["latency_s"]}
    if probe.hosts == 1:  # one host: the job's group is the host's
        return {"nbytes": nbytes, "between_hosts": None, "within_host": ring,
                "gather_bytes_per_s": rates["gather_bytes_per_s"], "scatter_bytes_per_s": rates["scatter_bytes_per_s"]}
    # Several: the whole group's ring is the between-hosts link, and the host's own group (if any) the
    # within; FSDP's gather and scatter rates are the host's (0, as the link's, with one rank a host).
    within = _within_host(nbytes, probe, device)
    return {"nbytes": nbytes, "between_hosts": ring,
            "within_host": {"bytes_per_s": within["bytes_per_s"], "latency_s": within["latency_s"]} if within else None,
            "gather_bytes_per_s": within["gather_bytes_per_s"] if within else 0.0,
            "scatter_bytes_per_s": within["scatter_bytes_per_s"] if within else 0.0}


def probe_in_job(recipe: ModuleType, spec: JobSpec, device: torch.device, probe: PlanProbeSpec) -> dict[str, Any]:
    """Measure on every rank of this job; rank 0 prints the figures (and every rank returns them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = spec.training.global_batch_size or 32 * world
    budget, source, host_budget = _budget_bytes(device, probe.ranks_per_host)
    request = {"global_batch_size": batch, "rows": max(1, batch // world), "seed": spec.training.seed,
               "memory_cap_bytes": budget if device.type != "cuda" else None,
               "tp_up_to": probe.ranks_per_host}  # a tensor-parallel group stays in one host
    # A sharded step is timed on one host's ranks only: over several hosts the cost model takes
    # sharded's collectives from the links' rates (planner/cost.py), and the step over a slow link
    # took most of the decision's 30 s.
    measured, last = measure_recipe(recipe, request, rank, world, device, time_links=False,
                                    time_sharded=probe.hosts == 1)
    nbytes = min(int(measured["profile"]["gradient_bytes"]), MAX_COLLECTIVE_BYTES)
    holds, why = _check_kept(probe.kept_links, nbytes, probe, device) if probe.kept_links else (False, "")
    links = probe.kept_links if holds else _time_links(nbytes, probe, device)
    assert links is not None
    measured = last()  # after the links: it sets this process's allocator as sharded's ranks run
    overheads = {**measured["overheads"], "gather_bytes_per_s": links["gather_bytes_per_s"],
                 "scatter_bytes_per_s": links["scatter_bytes_per_s"], "host_budget_bytes": host_budget}
    reply = {
        "profile": measured["profile"], "overheads": overheads, "budget_bytes": budget,
        "budget_source": source, "hosts": probe.hosts, "ranks_per_host": probe.ranks_per_host,
        "within_host": links["within_host"], "between_hosts": links["between_hosts"],
        # "kept": the client's figures held (why: the check); "timed": timed now, for the client to keep.
        "links": {"from": "kept" if holds else "timed", "why": why, "figures": links},
    }
    if rank == 0:
        print(PLAN_PROBE_MARK + json.dumps(reply), flush=True)
    return reply
