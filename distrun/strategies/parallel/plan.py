"""A tensor-parallel plan: which modules split how, from the recipe's ``tp_plan(model)`` or derived.

A plan maps module names to a style. ``colwise`` splits a layer's output features over the
tensor-parallel ranks (each computes its share of the outputs); ``rowwise`` splits its input
features and sums the partial outputs (one all-reduce); ``replicate`` keeps the module whole on
every rank. A colwise layer, elementwise work, then a rowwise layer is the Megatron pair: one
all-reduce forward and one backward for the whole pair. ``output`` splits a model's last
layer (a language model's head) by output features and gathers its output, so the loss sees
it whole. ``sequence`` marks a module that works on each position alone (a norm, dropout):
whole on every rank, as ``replicate``, unless ``--sequence-parallel``. torch ``ParallelStyle``
objects are accepted as values too, for anything the words do not say.

Under ``--sequence-parallel`` (Megatron's sequence parallelism, torchtitan's plan) the
activations between the split layers are split by sequence position (dimension 1) over the
tensor-parallel ranks, so what runs between them holds 1/N of them: a colwise layer gathers
its input from those slices, a rowwise layer's output is reduce-scattered into them (where
the pair's all-reduce was), a ``sequence`` module runs on its slice (``SequenceParallel``), a
rowwise ``nn.Embedding`` hands the first slices out and ``output`` gathers the last ones in. A
module left out of the plan would see a slice while taking its parameters' gradients for the
whole: ``check_sequence_gradients`` finds that on the first step and names the module.

Keys are module names or fnmatch patterns over them (``*.attn.q``). torch's
``parallelize_module`` only warns about a pattern that matches nothing, and a typo then trains
unsplit; here every key must match, and a word style must name an ``nn.Linear`` or
``nn.Embedding`` whose split dimension the tensor-parallel degree divides, or the job stops
before its first step naming the key.

Which layers pair up cannot be read off the module tree in general (the forward decides). Without
``tp_plan``, distrun derives a plan from two shapes of module:

- inside an ``nn.Sequential``: a Linear, only elementwise modules, then a Linear whose input is
  the first one's output (an MLP). This one is sure, the order being the forward's.
- a module whose Linear children all read one width but one, which writes that width back
  from what the others write (attention's q, k, v and o, with fewer k/v heads too; an MLP's up
  and down; SwiGLU's w1, w3 and w2, in any order): the readers colwise, the writer rowwise. The
  shapes fit, but only the forward knows whether it works out its local head count from them
  (``view(b, t, -1, head_dim)``), so such a plan is ``checked``: on the first batch, the split
  model's outputs must match rank 0's whole model's (``plan_check``), or the job stops naming
  ``tp_plan`` before its first step. Under ``--pp`` no whole model is kept, and only the first
  shape is derived.

Everything else is left whole, and the one line that reports the plan says so.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from distrun.config._suggest import did_you_mean
from distrun.errors import RecipeError

__all__ = ["STYLES", "TensorPlan", "resolve_plan", "style_object"]

STYLES = ("colwise", "rowwise", "output", "sequence", "replicate")

#: Modules that act on each feature alone: a colwise layer's shards pass through them unchanged.
_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU, nn.ELU,
                nn.Mish, nn.Hardswish, nn.Softplus, nn.ReLU6, nn.SELU, nn.CELU, nn.Hardtanh)


@dataclass(frozen=True)
class TensorPlan:
    """Module name -> style (a word of STYLES or a ParallelStyle), each name a real module."""

    styles: Mapping[str, Any]
    description: str  # the one line the chief prints: what is split, and where the plan came from
    #: derived from shapes the forward may not follow: the first batch must confirm it (``plan_check``)
    checked: bool = False

    @property
    def split(self) -> tuple[str, ...]:
        return tuple(name for name, style in self.styles.items() if style not in ("replicate", "sequence"))


def style_object(style: Any, module: nn.Module | None = None, *, sequence_parallel: bool = False,
                 loss_parallel: bool = False) -> ParallelStyle | None:
    """The torch style for a plan entry on ``module``; None for what distrun replicates itself
    (``replicate``, and ``sequence`` without ``--sequence-parallel``)."""
    if isinstance(style, ParallelStyle):
        return style
    if isinstance(module, nn.Embedding) and style == "rowwise":  # token ids come whole, never split
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sequence_parallel else Replicate())
    if style == "output" and loss_parallel:  # the logits stay split by class, as a DTensor, for the loss
        return ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Shard(-1),
                               use_local_output=False)
    if isinstance(module, nn.Embedding) and style == "colwise" and sequence_parallel:
        raise RecipeError("--sequence-parallel: a colwise nn.Embedding gives each rank some features of every "
                          "position; make the embedding rowwise, which hands out the sequence's slices")
    if not sequence_parallel:
        return {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
                "output": ColwiseParallel(output_layouts=Replicate()), "sequence": None, "replicate": None}[style]
    return {"colwise": ColwiseParallel(input_layouts=Shard(1)), "rowwise": RowwiseParallel(output_layouts=Shard(1)),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            "sequence": SequenceParallel(), "replicate": None}[style]


def resolve_plan(model: nn.Module, recipe_plan: Callable[[nn.Module], Any] | None, tp: int, *,
                 can_check: bool = True) -> TensorPlan:
    """The plan for ``model`` split over ``tp`` ranks: the recipe's, checked, or derived.
    ``can_check``: the first batch can confirm a plan derived from projection groups (not under --pp)."""
    _refuse_tied(model)
    if recipe_plan is not None:
        given = recipe_plan(model)
        if not isinstance(given, Mapping) or not given:
            raise RecipeError(f"tp_plan(model) must return a non-empty mapping of module name (or pattern) to "
                              f"{', '.join(STYLES)}. Received: {type(given).__name__}")
        styles = _expand(model, given, tp)
        counts = {pattern: sum(1 for name in styles if fnmatch.fnmatchcase(name, pattern)) for pattern in given}
        said = ", ".join(f"{pattern} {_word(style)}" + (f" ({counts[pattern]})" if counts[pattern] > 1 else "")
                         for pattern, style in given.items())
        return TensorPlan(styles, f"tensor parallel over {tp} ranks, the recipe's tp_plan: {said}")
    else:
        styles = _derive(model)
        grouped = _derive_groups(model, tp) if can_check else {}
        styles.update(grouped)
        if not styles:
            raise RecipeError("--tp: distrun found no layer it can split safely (a Linear, elementwise modules, "
                              "then a Linear, inside an nn.Sequential; or a module's projections: Linears that read "
                              "one width and one that writes it back); define tp_plan(model) in the recipe "
                              "(docs/recipes.md#tensor-parallel)")
        _check_sizes(model, styles, tp, lambda name: f"--tp: {name}")
    shown, more = _summary(styles)
    how = ("the MLP pairs of nn.Sequential and each module's projections, checked on the first batch"
           if grouped else "the MLP pairs of nn.Sequential")
    return TensorPlan(styles, f"tensor parallel over {tp} ranks, derived ({how}; the rest whole: tp_plan(model) "
                              f"says more): {shown}{more}", checked=bool(grouped))


def _summary(styles: Mapping[str, Any], shown: int = 6) -> tuple[str, str]:
    """``blocks.*.q colwise (12), ...``: layers of one style whose names differ in one index only (a
    ModuleList's) in one entry; the first few entries, and how many layers there are when more."""
    words = {name: _word(style) for name, style in styles.items()}
    counts: dict[tuple[str, str], int] = {}
    for name, word in words.items():
        parts = name.split(".")
        alike = [other.split(".") for other, its in words.items() if its == word and other != name]
        key = ".".join("*" if part.isdigit() and any(
            len(o) == len(parts) and o[:i] == parts[:i] and o[i + 1:] == parts[i + 1:] for o in alike) else part
            for i, part in enumerate(parts))
        counts[(key, word)] = counts.get((key, word), 0) + 1
    items = [f"{name} {word}" + (f" ({count})" if count > 1 else "") for (name, word), count in counts.items()]
    more = f", ... ({len(styles)} layers in all)" if len(items) > shown else ""
    return ", ".join(items[:shown]), more


def _word(style: Any) -> str:
    return style if isinstance(style, str) else type(style).__name__


def _refuse_tied(model: nn.Module) -> None:
    """One tensor under two names (tied embeddings) would be split under one and not the other."""
    seen: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen and seen[id(param)] != name:
            raise RecipeError(f"--tp: {seen[id(param)]} and {name} are one tensor (tied weights), which tensor "
                              "parallel cannot split in two places; untie them (give each its own parameter)")
        seen[id(param)] = name


def _expand(model: nn.Module, given: Mapping[Any, Any], tp: int) -> dict[str, Any]:
    names = [name for name, _ in model.named_modules() if name]
    styles: dict[str, Any] = {}
    pattern_of: dict[str, str] = {}
    for pattern, style in given.items():
        if not isinstance(pattern, str):
            raise RecipeError(f"tp_plan: keys are module names or fnmatch patterns. Received: {pattern!r}")
        if not (isinstance(style, ParallelStyle) or style in STYLES):
            raise RecipeError(f"tp_plan[{pattern!r}]: expected {', '.join(STYLES)} or a torch ParallelStyle. "
                              f"Received: {style!r}")
        matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            hint = did_you_mean(pattern, names) or f" (names look like {', '.join(names[:3])})"
            raise RecipeError(f"tp_plan[{pattern!r}]: matches no module of the model{hint}")
        for name in matched:
            if name in styles and _word(styles[name]) != _word(style):
                raise RecipeError(f"tp_plan: {name} is matched by {pattern_of[name]!r} ({_word(styles[name])}) "
                                  f"and by {pattern!r} ({_word(style)}); give each module one style")
            styles[name], pattern_of[name] = style, pattern
    _check_sizes(model, styles, tp, lambda name: f"tp_plan[{pattern_of[name]!r}]")
    return styles


def _check_sizes(model: nn.Module, styles: Mapping[str, Any], tp: int, label: Callable[[str], str]) -> None:
    """A word style names a Linear or an Embedding whose split dimension ``tp`` divides."""
    for name, style in styles.items():
        if not isinstance(style, str) or style in ("replicate", "sequence"):
            continue
        module = model.get_submodule(name)
        key = label(name)
        if isinstance(module, nn.Linear):
            size, what = (module.out_features, "output") if style in ("colwise", "output") \
                else (module.in_features, "input")
        elif isinstance(module, nn.Embedding) and style != "output":
            size, what = ((module.embedding_dim, "embedding dimension") if style == "colwise"
                          else (module.num_embeddings, "rows"))
        else:
            what_splits = "nn.Linear" if style == "output" else "nn.Linear and nn.Embedding"
            raise RecipeError(f"{key}: {style} splits {what_splits}; {name} is a {type(module).__name__} (a norm or "
                              "dropout is 'sequence'; give anything else a torch ParallelStyle, or leave it out)")
        if size % tp:
            raise RecipeError(f"{key}: {name}'s {size} {what} features do not split over --tp {tp}")


def _derive(model: nn.Module) -> dict[str, Any]:
    """Colwise/rowwise for each Linear -> elementwise* -> Linear run inside an nn.Sequential."""
    styles: dict[str, Any] = {}
    for prefix, container in model.named_modules():
        if not isinstance(container, nn.Sequential):
            continue
        children = list(container.named_children())
        index = 0
        while index < len(children):
            name, first = children[index]
            if not isinstance(first, nn.Linear):
                index += 1
                continue
            after = index + 1
            while after < len(children) and isinstance(children[after][1], _ELEMENTWISE):
                after += 1
            if after < len(children) and isinstance(children[after][1], nn.Linear) \
                    and children[after][1].in_features == first.out_features:
                styles[_join(prefix, name)] = "colwise"
                styles[_join(prefix, children[after][0])] = "rowwise"
                index = after + 1
            else:
                index += 1
    return styles


def _derive_groups(model: nn.Module, tp: int) -> dict[str, Any]:
    """In each module but an nn.Sequential: when its Linear children all read one width ``d`` but
    one, which writes ``d`` from the widest of what the others write, the readers colwise and the
    writer rowwise (``checked`` on the first batch). The writer is looked for from the last child
    back, so an MLP's up/down (shapes alike both ways) pairs in its order. Groups whose splits
    ``tp`` does not divide are left whole."""
    styles: dict[str, Any] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Sequential):
            continue
        linears = [(name, child) for name, child in module.named_children() if isinstance(child, nn.Linear)]
        if len(linears) < 2:
            continue
        for index in range(len(linears) - 1, -1, -1):
            name, writer = linears[index]
            readers = linears[:index] + linears[index + 1:]
            if all(r.in_features == writer.out_features for _, r in readers) \
                    and writer.in_features == max(r.out_features for _, r in readers) \
                    and not writer.in_features % tp and all(not r.out_features % tp for _, r in readers):
                styles.update({_join(prefix, reader): "colwise" for reader, _ in readers})
                styles[_join(prefix, name)] = "rowwise"
                break
    return styles


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
