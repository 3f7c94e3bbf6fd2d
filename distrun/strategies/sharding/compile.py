"""``--compile`` under sharded: each unit's forward compiled, before sharding (torchtitan's way).

Compiling the whole sharded model would put FSDP's all-gathers and reduce-scatters (module
hooks) inside one graph. torchtitan compiles each transformer block instead and shards
after, so the hooks stay eager around each compiled block and the communication of one
block overlaps the compute of the next, as in eager FSDP.

Each unit's ``forward`` is replaced, on the instance, by a compiled frame of distrun's own
that calls the original. Parameter names do not change (``torch.compile(unit)`` would add
``_orig_mod.`` to every name, and checkpoints would no longer match the other strategies'),
and a unit whose forward lives in torch's own files (an ``nn.Sequential``, a built-in
layer) is still compiled: TorchDynamo skips a frame that starts in torch's files, which is
why compilation starts in distrun's (the same trap ``step/compile.CompileRoot`` avoids).
Identical blocks share one compiled graph's code; each is guarded on its own module, as
torchtitan's blocks are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["compile_units"]


def compile_units(units: tuple[nn.Module, ...], mode: str) -> None:
    for unit in units:
        unit.forward = torch.compile(_own_frame(unit.forward), mode=None if mode == "default" else mode)


def _own_frame(forward: Callable[..., Any]) -> Callable[..., Any]:
    def forward_in_distrun(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    return forward_in_distrun
