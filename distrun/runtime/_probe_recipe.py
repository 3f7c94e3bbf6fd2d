"""The planner's measurements of a recipe, in whatever group of processes runs them.

``distrun.runtime.plan_probe`` runs them in processes of its own on this machine (for a local
``--strategy auto``); ``runtime/_cluster_probe.py`` in a cluster job's own ranks, across its hosts.
Either way every process of the group builds the recipe's model from the job's seed and measures
at once, as the job's ranks will compute at once (planner/probe.py says what is measured and how),
then the group times its collectives, each layout's fixed costs and distrun's own loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from distrun.planner.overheads import collective_rates, framework_overheads, fresh_bytes_per_s, pcie_bytes_per_s
from distrun.planner.probe import measure, resident_bytes, sharded_step
from distrun.runtime._loop_probe import loop_step_s
from distrun.runtime._move import to_device
from distrun.strategies import InputContext
from distrun.strategies.step.accumulation import batch_rows, split_batch

__all__ = ["MAX_COLLECTIVE_BYTES", "agree", "collective_device", "measure_recipe", "slowest_of"]

#: The largest all-reduce the group times (the gradients' bytes, capped).
MAX_COLLECTIVE_BYTES = 64 << 20


def agree(flag: bool, device: torch.device | None = None) -> bool:
    """True where every process of the default group says true (the smallest of their answers);
    ``device``: the group's (NCCL takes CUDA tensors only)."""
    answer = torch.tensor([int(flag)], device=device)
    dist.all_reduce(answer, op=dist.ReduceOp.MIN)
    return bool(answer.item())


def slowest_of(seconds: float, device: torch.device | None = None) -> float:
    """The largest of the default group's processes' ``seconds`` (one all-reduce; ``device``: the
    group's)."""
    reading = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(reading, op=dist.ReduceOp.MAX)
    return float(reading.item())


def collective_device(device: torch.device) -> torch.device:
    """Where the default group's tensors live: a CUDA device under NCCL (a cluster job's GPU ranks),
    else the CPU (gloo: the local probe, and CPU ranks)."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def _batches(recipe: ModuleType, batch_size: int, seed: int) -> Any:
    """``batch_of(count)``: a batch of ``count`` samples of the recipe's training data."""
    data = recipe.train_data(InputContext(1, 0, batch_size, seed))
    collate = torch.utils.data.default_collate
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        def batch_of(count: int) -> Any:
            return collate([data[i % len(data)] for i in range(count)])
        return batch_of
    first = next(iter(data))  # an iterable of batches: the first, cut to size

    def cut(count: int) -> Any:
        have = batch_rows(first) or count
        return split_batch(first, max(1, have // count))[0][0] if have > count else first
    return cut


def measure_recipe(recipe: ModuleType, request: dict[str, Any], rank: int, group_size: int,
                   device: torch.device, *, time_links: bool = True,
                   time_sharded: bool = True) -> tuple[dict[str, Any], Callable[[], dict[str, Any]]]:
    """The profile of ``recipe``'s model (``request``: ``global_batch_size``, ``rows`` a forward sees,
    ``seed``, ``memory_cap_bytes``), the default group's all-reduce link (None for a group of one)
    and the fixed costs; every process of the default group calls it at once. ``time_links=False``:
    the collectives' rates are not timed (a cluster's kept ones hold), so ``link`` is None and the
    overheads carry no gather or scatter rate. ``time_sharded=False``: no sharded step is timed over
    the group (the cost model uses one only for sharding inside a host: a cluster's hosts' group
    spans links whose step over 200 Mbit/s took 7-14 s, six times, past the decision's 30 s).

    Returns the figures and ``last``, which every process calls once, after whatever else it times
    (a cluster's links): it times the sharded step, which on CPU fixes the process's allocator as
    sharded's ranks run (planner/overheads.py), so nothing timed for the other layouts runs under
    it, or, on CPU where no such step is timed, what the pages sharded maps afresh cost instead;
    then it reads the device's free memory, and returns the figures whole."""
    # A rank's floor as its summary counts peaks: on CPU the process (the interpreter, torch, distrun,
    # a process group), on a GPU what CUDA's allocator holds (the context is outside it, and outside
    # the free memory the budget reads).
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else resident_bytes()
    seed = int(request.get("seed", 0))
    torch.manual_seed(seed)
    model = recipe.model()
    batch_of = _batches(recipe, int(request["global_batch_size"]), seed)
    forward = getattr(recipe, "forward", lambda m, b: m(b[0]))
    together = group_size > 1
    everyone = (lambda flag: agree(flag, collective_device(device))) if together else lambda flag: flag
    # A rank's budget (the client's, on CPU) or the GPU's free memory.
    cap = request.get("memory_cap_bytes") or (
        int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None)
    profile = measure(model=model, make_optimizer=recipe.optimizer, loss_fn=recipe.loss, forward=forward,
                      batch_of=lambda count: to_device(batch_of(count), device), rows=int(request["rows"]),
                      device=device, base_bytes=base, units_from=getattr(recipe, "shard_units", None),
                      chain_from=getattr(recipe, "pp_chain", None),
                      together=dist.barrier if together else lambda: None, agree=everyone,
                      slowest=(lambda seconds: slowest_of(seconds, collective_device(device))) if together
                      else lambda seconds: seconds,
                      memory_cap_bytes=cap, tp_plan_from=getattr(recipe, "tp_plan", None),
                      # --tp is a candidate on GPUs only (planner/choose.py): measured there alone.
                      tp_up_to=int(request.get("tp_up_to", group_size)) if device.type == "cuda" else 1)
    link, overheads = None, {}
    if together:
        overheads = framework_overheads(device)
    if together and time_links:
        rates = collective_rates(min(profile.gradient_bytes, MAX_COLLECTIVE_BYTES), device=collective_device(device))
        link = {"bytes_per_s": rates.pop("bytes_per_s"), "latency_s": rates.pop("latency_s")}
        overheads |= rates
    overheads["loop_step_s"] = loop_step_s(rank, group_size, device)
    if device.type == "cuda":  # --offload cpu's copies between host and GPU
        overheads["pcie_bytes_per_s"] = pcie_bytes_per_s(device)
    figures = {"profile": dataclasses.asdict(profile), "link": link, "overheads": overheads}
    held = [model]

    def last() -> dict[str, Any]:
        sharded_s = sharded_step(
            held[0], profile, make_optimizer=recipe.optimizer, loss_fn=recipe.loss, forward=forward,
            batch=to_device(batch_of(profile.probe_rows), device), units_from=getattr(recipe, "shard_units", None),
            agree=everyone, memory_cap_bytes=cap) if together and time_sharded else 0.0
        figures["profile"]["sharded_step_s"] = sharded_s
        if together and device.type == "cpu" and not sharded_s:  # whether it was timed is agreed among them
            figures["overheads"]["fresh_bytes_per_s"] = fresh_bytes_per_s()
        held.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # what the probe's own tensors left cached is the job's to use
        figures["device_free_bytes"] = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        return figures
    return figures, last
