"""``--strategy auto`` in the CLI: the layout chosen before the job is built, and said.

``train``, ``plan`` and ``--print-config`` share this: each asks :func:`choose` for the layout
of a recipe on this machine's ranks, which probes the recipe (client/planning.py) and returns the
flags the choice sets, the plan (None for a recipe the planner cannot probe), and the lines to
print. A layout flag given beside ``auto`` is refused: auto chooses it, and a user who wants it
fixed names the strategy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrun.cli._spec import local_layout, recipe_defaults
from distrun.client.planning import Plan, plan_local
from distrun.config import RecipeKind, inspect_recipe
from distrun.errors import UsageError
from distrun.launch import visible_gpu_count
from distrun.protocol import JobSummary

__all__ = ["AUTO", "Choice", "choose", "with_measured"]

AUTO = "auto"
#: The flags auto sets, with the value each has when nobody gave it.
_CHOSEN = {"tp": ("--tp", 1), "pp": ("--pp", 1), "microbatches": ("--microbatches", None),
           "activation_checkpointing": ("--activation-checkpointing", "none"), "accumulate": ("--accumulate", 1)}


@dataclass(frozen=True)
class Choice:
    """What auto set (``distrun train``'s parameter names), the plan behind it, the lines to say."""

    flags: dict[str, Any]
    plan: Plan | None
    lines: tuple[str, ...]


def choose(recipe: Path, *, replicas: int | None, device: str, global_batch_size: int | None, seed: int | None,
           recipe_args: tuple[str, ...] = (), given: dict[str, Any] | None = None) -> Choice:
    """The layout of ``recipe`` on this machine; ``given``: the layout flags as the command has them."""
    for name, (flag, unset) in _CHOSEN.items():
        value = (given or {}).get(name)
        if value not in (None, unset) and not (name == "microbatches" and value == 0):
            raise UsageError(f"--strategy auto chooses {flag} itself; drop {flag}, or name a strategy to pin a layout")
    path = recipe.expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"{recipe}: recipe not found")
    info = inspect_recipe(str(path))
    device, ranks = local_layout(device, replicas, visible_gpu_count())
    if info.kind is not RecipeKind.FIT:
        what = ("a plain script builds its own model and loop" if info.kind is RecipeKind.SCRIPT
                else "a custom loop builds its model inside main(strategy), where the probe cannot reach it")
        return Choice({"strategy": "mirrored", "replicas": ranks, "device": device}, None,
                      (f"auto: {what}, so it can only be placed, not laid out: mirrored x{ranks}",))
    filled = recipe_defaults(info, steps=None, epochs=None, global_batch_size=global_batch_size, seed=seed,
                             checkpoint_every=None)
    plan = plan_local(path, ranks=ranks, global_batch=int(filled["global_batch_size"]), seed=int(filled["seed"]),
                      device=device, args=recipe_args, evaluates="eval_data" in info.functions)
    flags = {**plan.decision.chosen.layout.flags(), "device": device}
    return Choice(flags, plan, tuple(plan.lines()))


def with_measured(plan: Plan, summary: JobSummary) -> JobSummary:
    """The summary with its ``plan``: the prediction, and beside it the run's own figures (the highest
    rank's peak, and the global batch over samples/s as the step time)."""
    peaks = summary.peak_mem_mb or {}
    peak = max(peaks.values()) if peaks else None
    step_s = plan.global_batch / summary.samples_per_s if summary.samples_per_s > 0 else None
    return dataclasses.replace(summary, plan=plan.summary_object(peak, step_s))
