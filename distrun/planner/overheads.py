"""What each layout costs a step whatever the model: timed on a tiny model among the probe's ranks.

A small model's step is mostly this: DDP's hooks and its one all-reduce call, FSDP2's
all-gather and reduce-scatter calls per unit, a pipeline schedule's sends, receives and Python
per microbatch. Each is timed here on the process group the probe formed (the job's backend,
its ranks on this host), so the cost model adds measured figures rather than constants:

- ``ddp_step_s``: a DDP step of one tiny layer (forward, backward with its all-reduce, step);
- ``shard_unit_s``: an FSDP2 step of a tiny chain of units, divided by its units and root;
- ``microbatch_s``: a 1F1B step over two stages, divided by its microbatches;
- ``tp_pair_s``: a step of a column-then-row pair of layers split over two ranks (``--tp 2``).

:func:`collective_rates` times the collectives themselves, on the gradients' size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distrun.strategies.sharding.allocator import fix_mmap_threshold

__all__ = ["COLLECTIVE_WITHIN_S", "SHARDED_WITHIN_S", "all_reduce_s", "collective_rates", "framework_overheads",
           "fresh_bytes_per_s", "pcie_bytes_per_s", "sharded_step_s"]

_STEPS = 5
#: A collective on the gradients' bytes is timed as often as fits in about this long after its
#: warm-up (at most ``_STEPS``; all of them while the warm-up takes under 0.3 s): over a 50 Mbit/s
#: link an 8.4 MB all-reduce takes 1.3 s, and six runs (a warm-up and five timed) of each of three
#: collectives took the decision past its 30 s. A slow link's time varies little from run to run.
COLLECTIVE_WITHIN_S = 1.5
#: About how long the probe times sharded's step for, after its first: a step of the 34M-parameter
#: model of ``bench auto`` took 2 s on this project's machine, and five of them were a third of the
#: decision's 30 s. One timed step is enough for what it decides (sharded against mirrored was 2.6x
#: there); the small models that are fast to step get the five.
SHARDED_WITHIN_S = 4.0

_WIDTH = 8
_UNITS = 4
_MICROBATCHES = 4


def _median_s(step: Callable[[], None], group: dist.ProcessGroup | None = None, within_s: float | None = None,
              device: torch.device | None = None) -> float:
    """The median of ``_STEPS`` timed runs of ``step`` after one that warms it up; with ``within_s``,
    only as many as fit in about that long at the warm-up's pace (at least one), the group agreeing
    on the slowest rank's count, as every rank must run the same collectives."""
    began = time.perf_counter()
    step()  # the first connects and allocates
    cuda = torch.cuda.is_initialized()  # NCCL's collectives and CUDA kernels return before they end
    if cuda:
        torch.cuda.synchronize()
    steps = _STEPS
    if within_s is not None:
        first = torch.tensor([time.perf_counter() - began], device=device)
        if dist.is_initialized():
            dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
        steps = max(1, min(_STEPS, int(within_s / max(float(first.item()), 1e-9))))
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        if dist.is_initialized():  # one GPU's probe has no group
            dist.barrier(group)
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _step_s(model: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """A training step of ``model`` (wrapped for its layout) on two rows, timed among ``group``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.zeros(2, _WIDTH, device=device)

    def step() -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    return _median_s(step, group)


def _ddp_step_s(device: torch.device) -> float:
    from torch.nn.parallel import DistributedDataParallel

    return _step_s(DistributedDataParallel(nn.Linear(_WIDTH, _WIDTH).to(device)), device)


def _shard_unit_s(device: torch.device) -> float:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(*(nn.Linear(_WIDTH, _WIDTH) for _ in range(_UNITS))).to(device)
    for unit in model:
        fully_shard(unit)
    fully_shard(model)
    return _step_s(model, device) / (_UNITS + 1)


def _tp_pair_s(device: torch.device, group: dist.ProcessGroup) -> float:
    """A step of a column-then-row pair of tiny Linears split over ``group`` (DTensor, as --tp
    splits a recipe's layers): what such a pair costs beyond its arithmetic and its bytes."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = DeviceMesh.from_group(group, device.type)
    pair = parallelize_module(nn.Sequential(nn.Linear(_WIDTH, _WIDTH), nn.Linear(_WIDTH, _WIDTH)).to(device), mesh,
                              {"0": ColwiseParallel(), "1": RowwiseParallel()})
    return _step_s(pair, device, group)


def _microbatch_s(device: torch.device, group: dist.ProcessGroup) -> float:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage = PipelineStage(nn.Linear(_WIDTH, _WIDTH).to(device), dist.get_rank(group), 2, device, group=group)
    schedule = Schedule1F1B(stage, n_microbatches=_MICROBATCHES, loss_fn=lambda out, target: out.sum())
    x = torch.zeros(2 * _MICROBATCHES, _WIDTH, device=device)

    def step() -> None:
        if dist.get_rank(group) == 0:
            schedule.step(x)
        else:
            schedule.step(target=x, losses=[])
    return _median_s(step, group) / _MICROBATCHES


def collective_rates(nbytes: int, group: dist.ProcessGroup | None = None,
                     device: torch.device | None = None) -> dict[str, float]:
    """The collectives' rates among ``group``'s ranks (the default group's), each timed on ``nbytes``
    (the gradients, capped): an all-reduce moves ``2(n-1)/n`` of them (its ``bytes_per_s``), an
    all-gather and a reduce-scatter ``(n-1)/n`` each. gloo runs the last two far slower than its
    ring all-reduce, which is why sharded pays more than its bytes say on CPU. One number's
    all-reduce gives a message's latency (``device``: the group's; the CPU by default)."""
    n = dist.get_world_size(group)
    shard = max(1, nbytes // 4 // n)
    # On the group's device: NCCL's collectives take CUDA tensors only.
    whole, part, one = (torch.zeros(count, device=device) for count in (shard * n, shard, 1))
    latency = _median_s(lambda: dist.all_reduce(one, group=group), group) / (2 * (n - 1))
    reduce_s = _median_s(lambda: dist.all_reduce(whole, group=group), group, COLLECTIVE_WITHIN_S, device)
    gather_s = _median_s(lambda: dist.all_gather_into_tensor(whole, part, group=group), group,
                         COLLECTIVE_WITHIN_S, device)
    scatter_s = _median_s(lambda: dist.reduce_scatter_tensor(part, whole, group=group), group,
                          COLLECTIVE_WITHIN_S, device)
    moved = (n - 1) / n * whole.numel() * 4
    return {"bytes_per_s": 2 * moved / max(reduce_s, 1e-9), "latency_s": latency,
            "gather_bytes_per_s": moved / max(gather_s, 1e-9), "scatter_bytes_per_s": moved / max(scatter_s, 1e-9)}


def all_reduce_s(nbytes: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> float:
    """One all-reduce of ``nbytes`` over ``group`` (the default group), timed: the check a kept link's
    figures must pass before a probe trusts them instead of timing the collectives again."""
    whole = torch.zeros(max(1, nbytes // 4), device=device)
    return _median_s(lambda: dist.all_reduce(whole, group=group), group)


#: What ``pcie_bytes_per_s`` copies: large enough that the copy's own latency does not count.
_PCIE_BYTES = 64 << 20


def pcie_bytes_per_s(device: torch.device) -> float:
    """The rate a pinned host tensor crosses to ``device`` and back (``--offload cpu`` copies each
    shard up before its gather and each gradient shard down), the mean of the two directions."""
    host = torch.empty(_PCIE_BYTES // 4, pin_memory=True)
    there = torch.empty(_PCIE_BYTES // 4, device=device)

    def both() -> None:
        there.copy_(host, non_blocking=True)
        host.copy_(there, non_blocking=True)
    took = _median_s(both)
    return 2 * _PCIE_BYTES / max(took, 1e-9)


def sharded_step_s(model: nn.Module, units: tuple[nn.Module, ...], make_optimizer: Callable[[Any], Any],
                   step_of: Callable[[nn.Module, Any], None]) -> float:
    """A step of the recipe's own model sharded over the default group (FSDP2 on each unit, then the
    root, as sharded does), timed. It holds what sharded costs beyond compute: the all-gathers and
    the reduce-scatter at the units' real sizes, and FSDP2's copies into and out of its buffers,
    which gloo's collective rates alone under-count. It shards ``model`` in place: call it last.

    On CPU it runs under the allocator setting sharded's CPU ranks run under (every buffer over
    1 MiB mapped fresh, strategies/sharding/allocator.py), which keeps their memory flat and costs
    time: measured (2 ranks on this project's 2-core machine, the 17M-parameter MLP of ``bench
    auto``), a step of 64 rows a rank took 0.65 s without it and 1.29 s with it, and the probe
    timing it without read sharded's training step a third to a half low. The setting is the
    process's from then on, which is one more reason to call it last."""
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    if device.type == "cpu":
        fix_mmap_threshold()
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    optimizer = make_optimizer(model.parameters())
    return _median_s(lambda: step_of(model, optimizer), within_s=SHARDED_WITHIN_S, device=device)


#: What ``fresh_bytes_per_s`` writes: over glibc's largest dynamic mmap threshold (32 MiB), so it is
#: mapped afresh each time under any allocator setting.
_FRESH_BYTES = 64 << 20


def fresh_bytes_per_s() -> float:
    """What memory mapped afresh costs a CPU rank beyond writing memory it already holds, as a rate
    (bytes/s of the difference), timed on every process of the default group at once: the kernel
    faults in and zeroes each page, and the ranks fault at once. Sharded's CPU ranks map nearly
    every buffer afresh (strategies/sharding/allocator.py); measured here, 64 MiB took 63 ms to
    write fresh and 8.5 ms held. The cost model reads it only where no sharded step was timed
    (planner/cost.py), so the probe times it only there."""
    fresh_s = _median_s(lambda: torch.empty(_FRESH_BYTES // 4).fill_(1.0))
    held = torch.empty(_FRESH_BYTES // 4)  # after: a process never holds two (a budget's probe is tight)
    held_s = _median_s(lambda: held.fill_(1.0))
    return _FRESH_BYTES / max(fresh_s - held_s, 1e-9)


def framework_overheads(device: torch.device) -> dict[str, float]:
    """Each layout's fixed costs a step, timed among the ranks of the default group."""
    figures = {"ddp_step_s": _ddp_step_s(device), "shard_unit_s": _shard_unit_s(device)}
    pair = dist.new_group([0, 1])  # every rank makes it; the first two time a pipeline and a --tp pair
    if dist.get_rank() < 2:
        figures["microbatch_s"] = _microbatch_s(device, pair)
        if device.type == "cuda":  # --tp's candidates are a GPU's only (planner/choose.py)
            figures["tp_pair_s"] = _tp_pair_s(device, pair)
    dist.barrier()
    return figures
