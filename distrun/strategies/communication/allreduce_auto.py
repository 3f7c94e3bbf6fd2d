"""``--allreduce auto``: time flat and hierarchical on the job's own buckets, keep the faster.

TensorFlow's ``CollectiveCommunication.AUTO`` leaves the choice to the runtime,
and "the best choice depends upon the number and kind of GPUs and the network
interconnect". distrun decides by measuring, once, before the first step:

- the message sizes are the job's own: the buckets DDP built for this model
  (``bucket_sizes`` of its logging data, in the order it reduces them), capped at
  :data:`PROBE_MAX_BYTES` a pass, so the probe stays well under a second on a LAN;
- each algorithm runs one untimed pass over the smallest bucket (connections,
  first-use allocations), then :data:`PROBE_PASSES` timed passes, interleaved;
- every rank's times are all-reduced with MAX before comparing, so every rank
  sees the same figures and keeps the same algorithm (a split choice would
  deadlock the first backward);
- hierarchical must win by :data:`MIN_GAIN`: flat is DDP's own native path.

No probe runs where the answer is known: NCCL (it already picks ring or tree
per message and topology, NCCL_ALGO; distrun leaves it), one host, one rank per
host (hierarchical would be the flat ring with extra steps), or PowerSGD (it runs
its own all-reduces).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["AllReduceChoice", "ddp_bucket_bytes", "known_choice", "probe_sizes", "probe"]

#: Bytes of the job's buckets timed per pass (the first buckets DDP reduces; the last one cut).
PROBE_MAX_BYTES = 8 * 2**20
PROBE_PASSES = 2
#: Hierarchical must be at least this much faster (a fraction of flat's time) to be chosen.
MIN_GAIN = 0.05


@dataclass(frozen=True)
class AllReduceChoice:
    """What ``auto`` kept, why, and the figures it compared (None where it did not probe)."""

    algorithm: str  # flat | hierarchical
    reason: str
    flat_ms: float | None = None
    hierarchical_ms: float | None = None


def known_choice(node_of_rank: list[int], *, backend: str, powersgd: bool) -> AllReduceChoice | None:
    """The choice where measuring cannot change it; None where a probe must decide."""
    hosts: dict[int, int] = {}
    for node in node_of_rank:
        hosts[node] = hosts.get(node, 0) + 1
    if backend == "nccl":
        return AllReduceChoice("flat", "NCCL chooses its own ring or tree for each message (NCCL_ALGO); "
                                       "distrun leaves it")
    if powersgd:
        return AllReduceChoice("flat", "PowerSGD runs its own all-reduces")
    if len(hosts) < 2:
        return AllReduceChoice("flat", "one host: nothing to arrange across hosts")
    if max(hosts.values()) < 2:
        return AllReduceChoice("flat", f"one rank on each of {len(hosts)} hosts: hierarchical would be the same ring")
    return None


def probe_sizes(bucket_bytes: list[int], cap_bytes: int = PROBE_MAX_BYTES) -> list[int]:
    """The buckets timed in one pass: DDP's, in its order, until ``cap_bytes`` (the last one cut)."""
    sizes, total = [], 0
    for size in bucket_bytes:
        if size <= 0:
            continue
        take = min(size, cap_bytes - total)
        if take <= 0:
            break
        sizes.append(take)
        total += take
    return sizes or [min(cap_bytes, 2**20)]


def probe(sizes_bytes: list[int], *, flat: Callable[[torch.Tensor], object],
          hierarchical: Callable[[torch.Tensor], object], dtype: torch.dtype, device: torch.device,
          hosts: int, slots: int, clock_s: Callable[[], float] = time.perf_counter) -> AllReduceChoice:
    """Time both algorithms on buffers of ``sizes_bytes`` (a collective: every rank calls it).

    ``clock_s`` reads the seconds each pass takes; a test gives it a clock its stand-ins advance,
    so the decision is checked on exact times rather than on sleeps a loaded host stretches.
    """
    element = torch.tensor([], dtype=dtype).element_size()
    buffers = [torch.zeros(max(1, size // element), dtype=dtype, device=device) for size in sizes_bytes]
    smallest = min(buffers, key=lambda b: b.numel())

    def timed(fn: Callable[[torch.Tensor], object], bufs: list[torch.Tensor]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock_s()
        for buf in bufs:
            fn(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return clock_s() - start

    timed(flat, [smallest])
    timed(hierarchical, [smallest])
    best = [float("inf"), float("inf")]
    for _ in range(PROBE_PASSES):
        best[0] = min(best[0], timed(flat, buffers))
        best[1] = min(best[1], timed(hierarchical, buffers))
    agreed = torch.tensor(best, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    flat_s, hier_s = (float(x) for x in agreed.tolist())
    total = sum(sizes_bytes)
    size = f"{total / 2**20:.1f} MB" if total >= 2**20 else f"{total / 2**10:.1f} KB"
    where = f"{len(sizes_bytes)} bucket(s), {size}, {hosts} hosts x {slots} ranks"
    figures = f"hierarchical {hier_s * 1e3:.0f} ms, flat {flat_s * 1e3:.0f} ms on this job's {where}"
    algorithm = "hierarchical" if hier_s < flat_s * (1 - MIN_GAIN) else "flat"
    return AllReduceChoice(algorithm, f"measured: {figures}", flat_ms=flat_s * 1e3, hierarchical_ms=hier_s * 1e3)


def ddp_bucket_bytes(ddp: torch.nn.Module) -> list[int]:
    """The bucket sizes DDP built, in bytes, in the order it reduces them (its logging data)."""
    try:
        text = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))  # type: ignore[operator]
        return [int(part) for part in text.split(",") if part.strip()]
    except (AttributeError, RuntimeError, ValueError):  # another torch: the parameters, one bucket each
        return [p.numel() * p.element_size() for p in reversed(list(ddp.parameters())) if p.requires_grad]
