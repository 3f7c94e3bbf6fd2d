"""Which blocks FSDP2 shards one by one: the recipe's ``shard_units(model)``, or distrun's pick.

Each unit is all-gathered just before its forward and freed after, so a unit is the
granularity of peak memory: the whole model as one unit would gather every parameter at
once. Transformer-shaped models have the right units already, their repeated blocks,
which is what torchtitan shards. Without a ``shard_units`` function distrun picks:

1. the largest container (``nn.ModuleList``/``nn.Sequential``) of two or more children of one
   class, by parameter count (a model's layers);
2. else the root's direct children that hold parameters, if there are two or more;
3. else nothing but the root.

Either way the root is sharded last, holding what no unit holds (embeddings, norms, heads).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from distrun.errors import RecipeError

__all__ = ["Units", "pick_units"]


@dataclass(frozen=True)
class Units:
    modules: tuple[nn.Module, ...]
    description: str  # one line: what was picked and why


def pick_units(model: nn.Module, recipe_units: Callable[[nn.Module], Iterable[nn.Module]] | None = None) -> Units:
    names = {id(module): name for name, module in model.named_modules()}
    if recipe_units is not None:
        chosen = tuple(recipe_units(model))
        for unit in chosen:
            if not isinstance(unit, nn.Module) or id(unit) not in names or unit is model:
                raise RecipeError(f"shard_units(model) must return submodules of the model (not the model itself). "
                                  f"Received: {type(unit).__name__}")
        return Units(chosen, f"{len(chosen)} unit(s) named by the recipe's shard_units: {_describe(chosen, names)}")
    best: tuple[int, nn.Module] | None = None
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kinds = Counter(type(child) for child in module.children() if _params(child))
        if not kinds:
            continue
        kind, count = kinds.most_common(1)[0]
        if count < 2:
            continue
        size = sum(_params(child) for child in module.children() if type(child) is kind)
        if best is None or size > best[0]:
            best = (size, module)
    if best is not None:
        container = best[1]
        kind = Counter(type(c) for c in container.children() if _params(c)).most_common(1)[0][0]
        chosen = tuple(child for child in container.children() if type(child) is kind)
        where = names[id(container)] or "the model"
        return Units(chosen, f"{len(chosen)} {kind.__name__} block(s) of {where}, the model's repeated children "
                             f"({100 * best[0] / max(1, _params(model)):.0f}% of its parameters)")
    children = tuple(child for child in model.children() if _params(child))
    if len(children) >= 2:
        return Units(children, f"the model's {len(children)} direct children that hold parameters: "
                               f"{_describe(children, names)}")
    return Units((), "the whole model as one unit (no repeated blocks, fewer than two children with parameters)")


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _describe(units: tuple[nn.Module, ...], names: dict[int, str]) -> str:
    shown = ", ".join(names[id(unit)] for unit in units[:4])
    return shown + (f", ... ({len(units)} in all)" if len(units) > 4 else "")
