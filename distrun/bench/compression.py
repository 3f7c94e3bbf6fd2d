"""`distrun bench compression --cluster FILE`: each ``--compression`` on one workload, in one run.

For ``none``, ``fp16``, ``bf16`` and ``powersgd:2``, one ``distrun train`` each of:

- the communication-bound workload (``_compression_recipe.py``): samples/s over the
  timed steps, the speed-up against ``none`` and the training loss after the same steps;
- the digits recipe (``recipes/digits.py``, real data): its held-out accuracy, what the
  compression costs a model that trains to convergence.

Contenders run one after another on the same cluster, so they share its links. Never
imports torch; the recipes do, on the cluster.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distrun.bench._runs import HERE, measurement, run_command
from distrun.errors import UsageError

__all__ = ["COMPRESSIONS", "digits_recipe", "run_compression"]

_RECIPE = HERE / "_compression_recipe.py"
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd:2")


def digits_recipe() -> Path:
    """recipes/digits.py of the source tree distrun runs from (the examples are not in the package)."""
    path = HERE.parents[1] / "recipes" / "digits.py"
    if not path.is_file():
        raise UsageError(f"bench compression: the digits recipe is not at {path}; it runs from a source checkout "
                         "of distrun (pip install -e .)")
    return path


def run_compression(*, cluster: Path, compressions: tuple[str, ...] = COMPRESSIONS, width: int = 1024,
                    batch: int = 32, steps: int = 20, digits: Path | None = None,
                    progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The report: one row per compression (samples_per_s, speedup_vs_none, loss, digits_accuracy)."""
    env = dict(os.environ)

    def train(recipe: Path, compression: str, *recipe_args: str) -> list[dict[str, Any]]:
        argv = [sys.executable, "-m", "distrun", "train", str(recipe), "--cluster", str(cluster), "--strategy",
                "multi-worker", "--json", "--no-fetch", "--compression", compression]
        return run_command([*argv, *(("--", *recipe_args) if recipe_args else ())], env)[1]

    digits = digits or digits_recipe()
    rows: list[dict[str, Any]] = []
    parameters = world = 0
    for compression in compressions:
        progress(f"{compression}: the communication-bound workload")
        out = train(_RECIPE, compression, "--width", str(width), "--batch", str(batch), "--steps", str(steps))
        found = measurement(out, "compression")
        summary = next(line for line in reversed(out) if line.get("type") == "summary")
        parameters, world = int(found["parameters"]), int(summary["replicas"])  # type: ignore[arg-type]
        progress(f"{compression}: digits")
        out = train(digits, compression)
        accuracy = next(line for line in reversed(out) if line.get("type") == "summary")["eval_metrics"]["accuracy"]
        rows.append({"compression": compression, "samples_per_s": float(found["samples_per_s"]),  # type: ignore[arg-type]
                     "loss": float(found["loss"]), "digits_accuracy": float(accuracy)})  # type: ignore[arg-type]
    base = next((row["samples_per_s"] for row in rows if row["compression"] == "none"), None)
    for row in rows:
        row["speedup_vs_none"] = row["samples_per_s"] / base if base else None
    return {"benchmark": "compression", "world_size": world, "parameters": parameters, "width": width,
            "batch_per_replica": batch, "timed_steps": steps, "rows": rows}
