"""`distrun bench layouts`: each rank's peak memory under --tp, --pp and activation checkpointing
against sharded, on one model whose activations dominate, in one run on this machine.

One ``distrun train`` of ``_pipeline_recipe.py`` per layout, one after another, every one on
two ranks and the same global batch (large, so that what a rank keeps for backward outweighs
the parameters): ``mirrored x2`` (the reference: the whole model and a replica's activations
on each rank), ``sharded x2``, ``mirrored --tp 2``, ``mirrored --pp 2``, and ``mirrored x2``
and ``sharded x2`` with ``--activation-checkpointing full`` and ``selective``. Each rank's
peak is its process's peak resident memory (VmHWM, on the CPU: the interpreter and torch
included, the same for every layout), read from the run's summary; the report gives the
highest rank's peak, the other ranks' highest, and the ratio of each to sharded's. Never
imports torch; the recipe does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from distrun.bench._runs import HERE, run_command

__all__ = ["LAYOUTS", "run_layouts"]

_RECIPE = HERE / "_pipeline_recipe.py"
#: (name, distrun train flags): two ranks each.
LAYOUTS = (
    ("mirrored x2", ("-s", "mirrored", "--replicas", "2")),
    ("sharded x2", ("-s", "sharded", "--replicas", "2")),
    ("mirrored --tp 2", ("-s", "mirrored", "--tp", "2")),
    ("mirrored --pp 2", ("-s", "mirrored", "--pp", "2")),
    ("mirrored x2, checkpointing full", ("-s", "mirrored", "--replicas", "2", "--activation-checkpointing", "full")),
    ("mirrored x2, checkpointing selective", ("-s", "mirrored", "--replicas", "2", "--activation-checkpointing",
                                             "selective")),
    ("sharded x2, checkpointing full", ("-s", "sharded", "--replicas", "2", "--activation-checkpointing", "full")),
)


def run_layouts(*, width: int = 512, layers: int = 8, batch: int = 4096, steps: int = 3,
                progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The report: one row per layout (peak_mb, others_peak_mb, vs_sharded, samples_per_s)."""
    env = dict(os.environ)
    rows: list[dict[str, Any]] = []
    for name, flags in LAYOUTS:
        progress(name)
        argv = [sys.executable, "-m", "distrun", "train", str(_RECIPE), *flags, "--device", "cpu", "--json",
                "--steps", str(steps), "--global-batch-size", str(batch), "--",
                "--width", str(width), "--layers", str(layers), "--samples", str(batch * steps)]
        out = run_command(argv, env)[1]
        summary = next(line for line in reversed(out) if line.get("type") == "summary")
        peaks = {int(rank): float(mb) for rank, mb in (summary.get("peak_mem_mb") or {}).items()}
        rows.append({"layout": name, "peak_mb": max(peaks.values()), "rank0_peak_mb": peaks.get(0),
                     "others_peak_mb": max((mb for rank, mb in peaks.items() if rank), default=None),
                     "samples_per_s": float(summary["samples_per_s"]), "final_loss": summary.get("final_loss")})
    base = next(row["peak_mb"] for row in rows if row["layout"] == "sharded x2")
    for row in rows:
        row["vs_sharded"] = row["peak_mb"] / base
    parameters = width * (256 + 1) + layers * (8 * width * width + 5 * width) + (width + 1) * 10
    return {"benchmark": "layouts", "parameters": parameters, "width": width, "layers": layers,
            "global_batch_size": batch, "steps": steps, "rows": rows}
