"""The first batch confirms a derived tensor-parallel plan: the split model's outputs against the whole's.

A plan derived from a module's projections (``plan._derive_groups``) fits the shapes, but only
the forward knows whether it follows the split: attention that works out its local head count
from shapes (``view(b, t, -1, head_dim)``) does; one that fixes it (``view(b, t, HEADS, -1)``)
computes heads of the wrong size, silently, and trains a different model. So before the first
step, on the first batch, every rank runs the split model (in eval mode, without gradients), and
rank 0 runs the whole model it kept aside; the outputs must agree, or every rank stops with one
line that names ``tp_plan``. It costs rank 0 a copy of the model in host memory until then, and
every rank one forward, once.

The check runs in a forward pre-hook on the prepared model, so it sees the first batch of a fit
recipe and of a custom loop alike; it removes itself before it runs.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from distrun.errors import RecipeError

__all__ = ["PlanCheck", "agree"]

#: The split model's outputs may differ from the whole model's by this much (relative, in norm) and
#: agree: sums in another order differ by ~1e-7 in fp32, by ~1e-3 with bf16 parameters (``--precision``
#: under FSDP); heads of the wrong size, or a projection the forward uses whole, differ by 5e-2 and more.
_RTOL = {False: 1e-3, True: 2e-2}


class PlanCheck:
    """``reference``: rank 0's whole model with its initial values (None on every other rank)."""

    def __init__(self, reference: nn.Module | None, label: str) -> None:
        self._reference = copy.deepcopy(reference).to("cpu").eval() if reference is not None else None
        self._label = label
        self._handle: Any = None

    def install(self, model: nn.Module) -> None:
        # Before FSDP's own pre-hook: the split forward below then runs FSDP's whole forward, unnested.
        self._handle = model.register_forward_pre_hook(self._first_forward, with_kwargs=True, prepend=True)

    def _first_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._handle.remove()
        problem: str | None = None
        outputs: list[torch.Tensor] = []
        try:
            was = module.training
            module.eval()
            try:
                with torch.no_grad(), _no_autocast():
                    outputs = _leaves(module(*args, **kwargs))
            finally:
                module.train(was)
        except Exception as exc:  # noqa: BLE001 - every rank's verdict goes to every rank, then all stop
            problem = f"the split model fails on the first batch: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if problem is None and self._reference is not None:
            with torch.no_grad():
                whole = _leaves(self._reference(*_on_cpu(args), **_on_cpu(kwargs)))
            problem, difference = agree(outputs, whole)
            if problem is None:
                print(f"[{self._label}] the derived plan holds on the first batch (outputs within {difference:.1g} "
                      "of the whole model's)", flush=True)
        self._reference = None  # rank 0 holds the whole model no longer
        verdicts: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, problem)
        found = next((verdict for verdict in verdicts if verdict), None)
        if found is not None:
            raise RecipeError(f"--tp: the derived plan does not hold: {found} (does the forward fix a head count "
                              "where it could read it off a shape, view(b, t, -1, head_dim)?); define "
                              "tp_plan(model) in the recipe (docs/recipes.md#tensor-parallel)")


def agree(split: list[torch.Tensor], whole: list[torch.Tensor]) -> tuple[str | None, float]:
    """(None, the largest relative difference) when the split model's outputs match the whole
    model's, else (what differs, it)."""
    if [tuple(t.shape) for t in split] != [tuple(t.shape) for t in whole]:
        return (f"its outputs have shapes {[tuple(t.shape) for t in split]}, the whole model's "
                f"{[tuple(t.shape) for t in whole]}"), float("inf")
    half = any(t.dtype in (torch.float16, torch.bfloat16) for t in split)
    worst = 0.0
    for a, b in zip(split, whole):
        if not b.numel() or not (a.is_floating_point() or b.is_floating_point()):
            continue
        a, b = a.double(), b.double()
        worst = max(worst, float(torch.linalg.vector_norm(a - b)) / max(float(torch.linalg.vector_norm(b)), 1e-12))
    if worst > _RTOL[half]:
        return f"its outputs differ from the whole model's by {worst:.2g} of their norm on the first batch", worst
    return None, worst


def _no_autocast() -> Any:
    """The check compares values, not precisions: the split model runs as the whole one does (only
    FSDP's ``param_dtype`` stays, which the tolerance allows for)."""
    stack = contextlib.ExitStack()
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def _leaves(outputs: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(outputs)
    return [(leaf.full_tensor() if isinstance(leaf, DTensor) else leaf).detach().to("cpu")
            for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _on_cpu(tree: Any) -> Any:
    return tree_map(lambda leaf: leaf.detach().to("cpu") if isinstance(leaf, torch.Tensor) else leaf, tree)
