"""`distrun bench allreduce --cluster FILE`: all-reduce bandwidth per size and algorithm, against the links.

One ``distrun train`` of ``_allreduce_recipe.py`` on the running cluster measures the
host-to-host links (raw TCP) and flat and hierarchical all-reduce at each size, the way
nccl-tests reports them (algbw, busbw). This module adds each row's busbw as a fraction
of the slowest link, the figure that says how much of the network the all-reduce uses.
Never imports torch; the recipe does, on the cluster.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distrun.bench._runs import HERE, measurement, run_command

__all__ = ["DEFAULT_SIZES_MB", "run_allreduce"]

_RECIPE = HERE / "_allreduce_recipe.py"
DEFAULT_SIZES_MB = (1.0, 4.0, 16.0, 64.0, 256.0)


def run_allreduce(*, cluster: Path, sizes_mb: tuple[float, ...] = DEFAULT_SIZES_MB, repeats: int = 5,
                  link_s: float = 1.0, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The report: ``rows`` (algorithm, size_mb, algbw_MBps, busbw_MBps, of_link), ``links``, ``link_MBps_min``."""
    progress(f"links, then {len(sizes_mb)} size(s) x flat and hierarchical on {cluster}")
    argv = [sys.executable, "-m", "distrun", "train", str(_RECIPE), "--cluster", str(cluster), "--strategy",
            "multi-worker", "--json", "--no-fetch", "--", "--sizes-mb", ",".join(f"{s:g}" for s in sizes_mb),
            "--repeats", str(repeats), "--link-s", f"{link_s:g}"]
    _, out = run_command(argv, dict(os.environ))
    report = dict(measurement(out, "allreduce"))
    slowest = report.get("link_MBps_min")
    for row in report["rows"]:  # type: ignore[union-attr]
        row["of_link"] = row["busbw_MBps"] / slowest if slowest else None
    report["benchmark"] = "allreduce"
    report.pop("bench", None)
    return report
