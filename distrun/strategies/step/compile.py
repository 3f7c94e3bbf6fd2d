"""``--compile``: torch.compile of the prepared model, and what the compiler did, as figures.

Order matters with DistributedDataParallel: the strategy wraps first and this compiles
the wrapper, so TorchDynamo sees DDP's buckets and its DDPOptimizer splits the graph at
bucket boundaries; the all-reduce of one bucket then overlaps the backward of the next,
as in eager DDP (compiling the inner module and wrapping after would leave one graph
whose gradients are all ready at once, with nothing to overlap).

One trap, found on torch 2.13: under a compiled DDP, TorchDynamo deliberately skips
DDP's own forward and starts compiling at the frame that calls the inner module. If
that module's ``forward`` lives in torch's own files (an ``nn.Sequential`` of built-in
layers, a common recipe), the frame is in Dynamo's skip list and *nothing* is compiled,
silently. ``CompileRoot`` puts one frame of distrun's own between DDP and the recipe's
model, so compilation always starts there and traces into the model.

Graph breaks and recompilations are what make a compiled model slow without an error;
``CompileWatch`` reads TorchDynamo's counters after each step (dictionary reads, no
device work) and reports a change as a ``compile`` event, with the first reasons.

Compiled kernels are cached on disk per host (``cache_dir``): Inductor's FX-graph and
AOT-autograd caches, under the worker server's folder on a cluster (the warm cluster
compiles once) or under the user's cache folder locally.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["CompileStats", "CompileWatch", "CompileRoot", "compile_model", "use_cache_dir", "plain_module"]

#: Reasons kept per event; each is cut to its first line (Dynamo's explanations run long).
_MAX_REASONS = 3
#: Graph breaks DDP makes by design (Dynamo skips DDP's forward and compiles the module
#: under it); they cost nothing per step and are not the recipe's, so they are not counted.
_DDP_BREAKS = ("set_runtime_stats_and_log", "DistributedDataParallel._inside_ddp_forward")


def use_cache_dir(root: str | None) -> Path:
    """Point Inductor's (and Triton's) caches at ``root``/inductor, unless the user chose one."""
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "distrun"
    path = base / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(path))
    os.environ.setdefault("TRITON_CACHE_DIR", str(path / "triton"))
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def compile_model(model: nn.Module, mode: str) -> nn.Module:
    import torch

    return torch.compile(model, mode=None if mode == "default" else mode)


class CompileRoot(nn.Module):
    """A forward of distrun's own above the recipe's model: where compilation starts."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def plain_module(model: nn.Module) -> nn.Module:
    """The recipe's module under every wrapper: torch.compile's, DDP's, ``CompileRoot``, ``ElasticModel``."""
    from torch.nn.parallel import DistributedDataParallel

    from distrun.strategies.elastic.replica import ElasticModel

    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, (DistributedDataParallel, CompileRoot, ElasticModel)):
            model = model.module
        else:
            return model


@dataclass(frozen=True)
class CompileStats:
    """What TorchDynamo did so far in this process."""

    graphs: int
    graph_breaks: int
    recompiles: int
    compile_s: float
    reasons: tuple[str, ...] = ()


class CompileWatch:
    """Turns TorchDynamo's process-wide counters into ``CompileStats`` when they change."""

    def __init__(self) -> None:
        self._last: CompileStats | None = None
        self._first_graphs: int | None = None

    def poll(self) -> CompileStats | None:
        """New figures since the last poll, or None when nothing changed."""
        from torch._dynamo.utils import compilation_time_metrics, counters

        graphs = int(counters["stats"].get("unique_graphs", 0))
        breaks = {reason: n for reason, n in counters["graph_break"].items()
                  if not any(mark in reason for mark in _DDP_BREAKS)}
        if self._first_graphs is None and graphs:
            self._first_graphs = graphs  # the first step compiles the model: not a recompilation
        stats = CompileStats(
            graphs=graphs,
            graph_breaks=sum(breaks.values()),
            recompiles=max(0, graphs - (self._first_graphs or graphs)),
            compile_s=round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 3),
            reasons=tuple(_first_line(reason) for reason in list(breaks)[:_MAX_REASONS]),
        )
        if self._last is not None and (stats.graphs, stats.graph_breaks) == (self._last.graphs, self._last.graph_breaks):
            return None
        self._last = stats
        return stats


def _first_line(reason: Any) -> str:
    lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines else "?"
    return text[:200]
