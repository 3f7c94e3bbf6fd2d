"""`distrun bench slowlinks --cluster FILE`: what diloco buys on the links as they are, in one run.

``distrun train`` runs of ``_pipeline_recipe.py`` (an MLP: 2.2M parameters at the defaults, a
small batch, so a step's exchange outweighs its compute on a slow link) on the same cluster,
one after another, each for the same steps of the same global batches:

- ``multi-worker``: gradients all-reduced every step (the baseline);
- ``multi-worker powersgd``: the same, PowerSGD-compressed;
- ``diloco H=10`` and ``diloco H=50``: a sync every H steps;
- ``streaming diloco``: H=10 in 4 fragments, int8 pseudo-gradients.

For each: bytes per step (what the training hosts' interfaces sent while the ranks ran, from
each rank's ``done``: the kernel's counters, so everything on the wire counts), seconds per
step (from the first step's end to the last's), and the eval loss (``--eval-every``) both at
the end of the steps (equal steps) and at the wall time the fastest contender needed for all
of its steps (equal wall time), plus the time each needed to reach multi-worker's final eval
loss. Never imports torch; the recipe does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distrun.bench._runs import HERE, run_command

__all__ = ["CONTENDERS", "run_slowlinks"]

_RECIPE = HERE / "_pipeline_recipe.py"
#: (name, distrun train flags).
CONTENDERS = (("multi-worker", ("--strategy", "multi-worker")),
              ("multi-worker powersgd", ("--strategy", "multi-worker", "--compression", "powersgd",
                                         "--powersgd-warmup", "2")),
              ("diloco H=10", ("--strategy", "diloco", "--sync-every", "10")),
              ("diloco H=50", ("--strategy", "diloco", "--sync-every", "50")),
              ("streaming diloco H=10 K=4 int8", ("--strategy", "diloco", "--sync-every", "10", "--fragments", "4",
                                                  "--sync-dtype", "int8")))


def run_slowlinks(*, cluster: Path, width: int = 256, layers: int = 4, batch: int = 32, steps: int = 100,
                  eval_every: int = 10, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The report: one row per contender, and the baseline's figures each is compared with."""
    env = dict(os.environ)
    rows: list[dict[str, Any]] = []
    for name, flags in CONTENDERS:
        progress(name)
        argv = [sys.executable, "-m", "distrun", "train", str(_RECIPE), "--cluster", str(cluster), *flags, "--json",
                "--no-fetch", "--steps", str(steps), "--global-batch-size", str(batch), "--eval-every", str(eval_every),
                "--", "--width", str(width), "--layers", str(layers)]
        rows.append(_row(name, run_command(argv, env)[1], steps))
    finished_s = min(row["train_s"] for row in rows)
    base = rows[0]
    for row in rows:
        row["eval_loss_at_equal_time"] = _loss_at(row["curve"], finished_s)
        row["time_to_baseline_loss_s"] = _time_to(row["curve"], base["eval_loss"])
        row["bytes_vs_baseline"] = base["bytes_per_step"] / row["bytes_per_step"] if row["bytes_per_step"] else None
    parameters = width * (256 + 1) + layers * (8 * width * width + 5 * width) + (width + 1) * 10
    return {"benchmark": "slowlinks", "parameters": parameters, "width": width, "layers": layers,
            "global_batch_size": batch, "steps": steps, "eval_every": eval_every, "equal_time_s": finished_s,
            "rows": rows, "goals": {"bytes_vs_baseline_at_h10": 5.0}}


def _row(name: str, lines: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    summary = next(line for line in reversed(lines) if line.get("type") == "summary")
    chief_steps = [line for line in lines if line.get("type") == "step" and line.get("rank") == 0]
    first = next(line["time"] for line in chief_steps)  # the end of step 1
    last = chief_steps[-1]["time"]
    curve = [(float(line["time"]) - first, float(line["metrics"]["loss"]), int(line["step"]))
             for line in lines if line.get("type") == "eval"]
    sent = summary.get("net_mb_sent")
    return {"contender": name, "steps": summary["steps"], "outer_steps": summary.get("outer_steps"),
            "bytes_per_step": sent * 1e6 / steps if sent is not None else None,
            "step_s": (last - first) / max(1, int(chief_steps[-1]["step"]) - 1),
            "train_s": last - first, "eval_loss": curve[-1][1] if curve else None,
            "curve": curve, "final_loss": summary.get("final_loss")}


def _loss_at(curve: list[tuple[float, float, int]], at_s: float) -> float | None:
    """The newest eval loss at or before ``at_s`` seconds (None: none yet)."""
    before = [loss for t, loss, _ in curve if t <= at_s + 1e-9]
    return before[-1] if before else None


def _time_to(curve: list[tuple[float, float, int]], target: float | None) -> float | None:
    """Seconds until the eval loss was first at or below ``target`` (None: never)."""
    if target is None:
        return None
    return next((t for t, loss, _ in curve if loss <= target), None)
