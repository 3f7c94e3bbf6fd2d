"""A model as a chain of modules, cut into pipeline stages: what each rank keeps, under the model's names.

``--pp`` needs the model's forward as a chain: an ordered list of modules, each taking what
the one before gives, whose composition is the forward. An item gives one tensor, or a tuple
of tensors that the next item takes as its arguments (``h, skip = item(x)`` then
``next_item(h, skip)``): so a stage can pass several tensors to the next, as torch's
``PipelineStage`` sends a tuple of outputs as the next stage's arguments. An ``nn.Sequential`` is its own chain
(its children); any other model names one with the recipe's ``pp_chain(model)``, e.g.
``[model.embed, *model.blocks, model.norm, model.head]``. That the composition really is the
forward cannot be read off the code, so rank 0 checks it on the first batch, before step 1
(``check_chain``), and the job stops in one line if it is not.

The chain is cut into contiguous stages balanced by parameter count (the split that makes the
heaviest stage lightest), and each rank keeps its stages only: a stage is the model's root
with every other chain item taken out of its parent, so its parameters keep the names they
have in the whole model (``blocks.3.mlp.0.weight``), as torchtitan keeps them with its
``ModuleDict`` layers. A checkpoint written by the stages is then one checkpoint of the
whole model, which any layout reads.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distrun.errors import RecipeError

__all__ = ["Chain", "Cut", "chain_of", "check_chain", "cut_chain", "keep_stages", "meta_copy"]


@dataclass(frozen=True)
class Chain:
    """The model's chain: each item's name in the model, in order of the forward."""

    names: tuple[str, ...]
    parameters: tuple[int, ...]  # each item's parameter count
    source: str  # "nn.Sequential" or "the recipe's pp_chain"


@dataclass(frozen=True)
class Cut:
    """Which chain items each stage holds: ``bounds[s]`` to ``bounds[s + 1]``."""

    bounds: tuple[int, ...]

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def items(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def describe(self, chain: Chain) -> str:
        parts = []
        for stage in range(self.stages):
            items = self.items(stage)
            first, last = chain.names[items[0]], chain.names[items[-1]]
            params = sum(chain.parameters[i] for i in items)
            parts.append(f"stage {stage} = {first}" + (f"..{last}" if last != first else "") + f" ({params:,} params)")
        return "; ".join(parts)


def chain_of(model: nn.Module, recipe_chain: Callable[[nn.Module], Sequence[nn.Module]] | None) -> Chain:
    """The chain of ``model``: the recipe's ``pp_chain(model)``, or an ``nn.Sequential``'s children."""
    names = {id(module): name for name, module in model.named_modules() if name}
    if recipe_chain is not None:
        items = list(recipe_chain(model))
        for item in items:
            if not isinstance(item, nn.Module) or id(item) not in names:
                raise RecipeError(f"pp_chain(model) must return submodules of the model, in forward order. "
                                  f"Received: {type(item).__name__}")
        source = "the recipe's pp_chain"
    elif isinstance(model, nn.Sequential):
        items, source = list(model.children()), "nn.Sequential"
    else:
        raise RecipeError(f"--pp: the model is a {type(model).__name__}, not an nn.Sequential, so distrun cannot "
                          "tell its layers' order; define pp_chain(model) in the recipe, e.g. "
                          "[model.embed, *model.blocks, model.head] (docs/recipes.md#pipeline-parallel-pp_chain)")
    chain_names = tuple(names[id(item)] for item in items)
    if len(set(chain_names)) != len(chain_names):
        raise RecipeError("pp_chain(model): a module appears twice; each runs once in the forward")
    for name in chain_names:
        inside = [other for other in chain_names if other != name and other.startswith(name + ".")]
        if inside:
            raise RecipeError(f"pp_chain(model): {inside[0]} is inside {name}; name each layer once")
    covered = [pname for pname, _ in model.named_parameters()
               if not any(pname.startswith(name + ".") for name in chain_names)]
    if covered:
        raise RecipeError(f"pp_chain(model) leaves out {covered[0]}: every parameter must be in one item of the "
                          "chain (a stage trains only what its items hold)")
    params = tuple(sum(p.numel() for p in model.get_submodule(name).parameters()) for name in chain_names)
    return Chain(chain_names, params, source)


def cut_chain(chain: Chain, stages: int) -> Cut:
    """Contiguous stages whose heaviest holds the fewest parameters (every stage one item at least)."""
    count = len(chain.names)
    if count < stages:
        raise RecipeError(f"--pp: the chain ({chain.source}) has {count} module(s), fewer than the {stages} "
                          "pipeline stages; split the model finer, or use fewer stages")
    weights = [max(1, p) for p in chain.parameters]  # a parameter-free item still costs a step
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    # best[s][i]: the lightest heaviest stage for the first i items in s stages; choice[s][i] its last cut.
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(stages + 1)]
    choice = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, count + 1):
            for j in range(s - 1, i):
                heaviest = max(best[s - 1][j], prefix[i] - prefix[j])
                if heaviest < best[s][i]:
                    best[s][i], choice[s][i] = heaviest, j
    bounds = [count]
    for s in range(stages, 0, -1):
        bounds.append(choice[s][bounds[-1]])
    return Cut(tuple(reversed(bounds)))


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device, allocating nothing (rank 0 keeps its real model
    to check the chain, and builds its stages from this)."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def keep_stages(model: nn.Module, chain: Chain, items: Sequence[int]) -> nn.Module:
    """``model`` pruned to the chain items ``items`` (contiguous, in order), its forward their composition.

    Every other item is taken out of its parent (``del parent._modules[key]``: a ModuleList keeps
    its other keys, so names do not shift), which is why the model must be this rank's own copy.
    """
    kept = [chain.names[i] for i in items]
    for index, name in enumerate(chain.names):
        if index in items:
            continue
        parent_name, _, key = name.rpartition(".")
        del model.get_submodule(parent_name)._modules[key]
    modules = [model.get_submodule(name) for name in kept]

    def forward(self: nn.Module, *args: Any) -> Any:
        x: Any = args if len(args) != 1 else args[0]
        for module in modules:
            x = call_item(module, x)
        return x

    model.forward = types.MethodType(forward, model)
    return model


def call_item(module: nn.Module, x: Any) -> Any:
    """One chain item on what the one before gave: a tuple is its arguments, a tensor its one."""
    return module(*x) if isinstance(x, tuple) else module(x)


def _tensors(value: Any) -> tuple[torch.Tensor, ...] | None:
    """``value`` as a tuple of tensors (one tensor: a tuple of one), or None if it is neither."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, tuple) and value and all(isinstance(item, torch.Tensor) for item in value):
        return value
    return None


def check_chain(model: nn.Module, chain: Chain, inputs: Any, *, atol: float = 1e-5) -> str | None:
    """Rank 0's check on the first batch: the chain's composition against the model's forward
    (in eval mode: dropout would make any two forwards differ). Why it fails, or None."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(inputs)
            x = inputs
            for name in chain.names:
                x = call_item(model.get_submodule(name), x)
                if _tensors(x) is None:
                    return (f"pp_chain(model): {name} returns a {type(x).__name__}; each item of the chain must "
                            "return a tensor, or a tuple of tensors (the next item's arguments)")
    finally:
        model.train(was_training)
    got, want = _tensors(x), _tensors(expected)
    assert got is not None
    if want is None or [t.shape for t in want] != [t.shape for t in got]:
        shape = [tuple(t.shape) for t in want] if want is not None else type(expected).__name__
        return (f"the chain ({chain.source}) does not compose to the model's forward: it gives shape "
                f"{[tuple(t.shape) for t in got] if len(got) > 1 else tuple(got[0].shape)} where the model "
                f"gives {shape[0] if isinstance(shape, list) and len(shape) == 1 else shape}")
    worst = max((float((a.float() - b.float()).abs().max()) if a.numel() else 0.0) for a, b in zip(want, got))
    if not worst <= atol:
        return (f"the chain ({chain.source}) does not compose to the model's forward: on the first batch they "
                f"differ by up to {worst:.3g}; the forward does more than call the chain in order")
    return None
