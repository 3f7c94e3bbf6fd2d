"""`distrun bench pipeline --cluster FILE`: pipeline stages against replicas across slow links, in one run.

Three ``distrun train`` runs of ``_pipeline_recipe.py`` (an MLP of 33.8M parameters at the
defaults, a small batch) on the same cluster, one after another: ``multi-worker`` (each host
a whole replica, gradients all-reduced every step), ``sharded`` (FSDP2 over every rank:
parameters all-gathered and gradients reduce-scattered every step) and ``multi-worker --pp
2`` (one replica, its stages on different hosts: only a microbatch's activations cross, and
their gradients back). Each contender trains the same global batches; the report gives each
one's samples/s (the summary's mean after step 1) and its ratio to sharded's, the issue's
measure (goal: at least 3x on a 100 Mbit link). Never imports torch; the recipe does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distrun.bench._runs import HERE, run_command

__all__ = ["CONTENDERS", "run_pipeline"]

_RECIPE = HERE / "_pipeline_recipe.py"
#: (name, distrun train flags).
CONTENDERS = (("multi-worker", ("--strategy", "multi-worker")),
              ("sharded", ("--strategy", "sharded", "--shard-within", "all")),
              ("multi-worker --pp 2", ("--strategy", "multi-worker", "--pp", "2")))


def run_pipeline(*, cluster: Path, width: int = 1024, layers: int = 4, batch: int = 32, steps: int = 10,
                 progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The report: one row per contender (samples_per_s, vs_sharded, step_s, peak_mb)."""
    env = dict(os.environ)
    rows: list[dict[str, Any]] = []
    for name, flags in CONTENDERS:
        progress(name)
        argv = [sys.executable, "-m", "distrun", "train", str(_RECIPE), "--cluster", str(cluster), *flags, "--json",
                "--no-fetch", "--steps", str(steps), "--global-batch-size", str(batch), "--",
                "--width", str(width), "--layers", str(layers)]
        out = run_command(argv, env)[1]
        summary = next(line for line in reversed(out) if line.get("type") == "summary")
        rate = float(summary["samples_per_s"])  # type: ignore[arg-type]
        peaks = summary.get("peak_mem_mb") or {}
        rows.append({"contender": name, "samples_per_s": rate, "step_s": batch / rate if rate else None,
                     "mesh": summary.get("mesh"), "ranks": len(peaks),
                     "peak_mb": max(peaks.values(), default=None), "final_loss": summary.get("final_loss")})
    base = next(row["samples_per_s"] for row in rows if row["contender"] == "sharded")
    for row in rows:
        row["vs_sharded"] = row["samples_per_s"] / base if base else None
    parameters = width * (256 + 1) + layers * (8 * width * width + 5 * width) + (width + 1) * 10
    return {"benchmark": "pipeline", "parameters": parameters, "width": width, "layers": layers,
            "global_batch_size": batch, "steps": steps, "rows": rows, "goal_vs_sharded": 3.0}
