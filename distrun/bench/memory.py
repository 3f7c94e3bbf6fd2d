"""`distrun bench memory`: what each rank holds under mirrored and under sharded, in one run.

One ``distrun train`` of ``_memory_recipe.py`` (100.7M parameters, Adam, on the CPU) per
strategy and replica count (1, 2, 4 by default), one after another. Each run reports, per
rank, the bytes of parameters, gradients and optimizer state it holds (what sharding divides
by N) and its peak resident memory against its resident memory before the model was built
(what the whole process pays). The ratios are sharded's figure over mirrored's at the same
replica count: the issue's goal is at most 0.35 for the model state at 4 replicas.

Sharded's rank 0 builds the seeded model whole before sharding it (every other rank builds
it on the meta device), so its peak includes the full parameters once: rank 0 and the other
ranks are reported apart. Never imports torch; the recipe does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from distrun.bench._runs import HERE, measurement, run_command

__all__ = ["STRATEGIES", "run_memory"]

_RECIPE = HERE / "_memory_recipe.py"
STRATEGIES = ("mirrored", "sharded")


def _row(strategy: str, replicas: int, ranks: list[dict[str, float]]) -> dict[str, Any]:
    state = [rank["params_mb"] + rank["grads_mb"] + rank["optimizer_mb"] for rank in ranks]
    added = [rank["peak_mb"] - rank["base_mb"] for rank in ranks]
    return {"strategy": strategy, "replicas": replicas, "ranks": ranks, "state_mb": max(state),
            "peak_mb_rank0": ranks[0]["peak_mb"], "added_mb_rank0": added[0],
            "peak_mb_others": max((rank["peak_mb"] for rank in ranks[1:]), default=None),
            "added_mb_others": max(added[1:], default=None)}


def run_memory(*, replica_counts: tuple[int, ...] = (1, 2, 4), width: int = 2048, layers: int = 24, steps: int = 3,
               progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    env = dict(os.environ)
    rows: list[dict[str, Any]] = []
    parameters = 0
    for replicas in replica_counts:
        for strategy in STRATEGIES:
            progress(f"{strategy} x{replicas}")
            argv = [sys.executable, "-m", "distrun", "train", str(_RECIPE), "--strategy", strategy, "--replicas",
                    str(replicas), "--device", "cpu", "--json", "--", "--width", str(width), "--layers", str(layers),
                    "--steps", str(steps)]
            found = measurement(run_command(argv, env)[1], "memory")
            parameters = int(found["parameters"])  # type: ignore[arg-type]
            rows.append(_row(strategy, replicas, found["ranks"]))  # type: ignore[arg-type]
    ratios = []
    for replicas in replica_counts:
        mirrored, sharded = (next(r for r in rows if r["strategy"] == s and r["replicas"] == replicas)
                             for s in STRATEGIES)
        ratio = {"replicas": replicas, "state": sharded["state_mb"] / mirrored["state_mb"],
                 "added_rank0": sharded["added_mb_rank0"] / mirrored["added_mb_rank0"]}
        if sharded["added_mb_others"] is not None and mirrored["added_mb_others"]:
            ratio["added_others"] = sharded["added_mb_others"] / mirrored["added_mb_others"]
        ratios.append(ratio)
    return {"benchmark": "memory", "parameters": parameters, "width": width, "layers": layers, "steps": steps,
            "optimizer": "Adam", "rows": rows, "ratios": ratios, "goal_state_ratio_at_4": 0.35}
