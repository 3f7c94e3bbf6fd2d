"""`distrun bench elastic --cluster FILE`: recovery from a lost rank, elastic against a restart.

The same job twice, on the same cluster, in one run: the last rank SIGKILLs itself at
step ``kill_at`` (``_elastic_recipe.py``).

- ``--elastic MIN:N`` (N worker hosts, MIN one fewer): the others go on from memory.
- ``--max-restarts 1`` from a checkpoint written every ``checkpoint_every`` steps: every
  rank is restarted and resumes from the newest checkpoint (torchrun's way).

Figures, per contender, all timed on this machine's clock as the events arrive here (so
the hosts' clocks do not enter): ``recovery_s``, from the lost rank's exit to the next
committed step; ``back_s``, from the exit until the job has committed a step beyond the one
it had reached (the step that failed); and ``steps_redone``, the committed steps trained again. Every step event
is sent (``--log-interval-s 0``). Never imports torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distrun.bench._runs import HERE, TIMEOUT_S
from distrun.errors import DistrunError

__all__ = ["run_elastic"]

_RECIPE = HERE / "_elastic_recipe.py"


def run_elastic(*, cluster: Path, hosts: int, steps: int = 60, kill_at: int = 30, checkpoint_every: int = 10,
                sleep_s: float = 0.02, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The report: one row per contender (recovery_s, back_s, steps_redone) and elastic's speed-ups
    (restart's time over elastic's: ``speedup`` on recovery_s, ``speedup_back`` on back_s)."""
    if hosts < 2:
        raise DistrunError("bench elastic: needs a cluster of two or more worker hosts (one may be lost)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="distrun-bench-elastic-") as folder:
        for name, flags in (("elastic", ["--elastic", f"{hosts - 1}:{hosts}"]),
                            ("restart", ["--max-restarts", "1", "--checkpoint-dir", f"{folder}/ck",
                                         "--checkpoint-every", str(checkpoint_every)])):
            progress(f"{name}: {steps} steps, the last rank killed at step {kill_at}")
            once = f"{folder}/{name}.once"
            argv = [sys.executable, "-m", "distrun", "train", str(_RECIPE), "--cluster", str(cluster), "--strategy",
                    "multi-worker", "--json", "--no-fetch", "--log-interval-s", "0", "--steps", str(steps), *flags,
                    "--", "--die-rank", str(hosts - 1), "--die-at", str(kill_at), "--once", once,
                    "--sleep-s", str(sleep_s)]
            rows.append({"contender": name, **_timed(argv, kill_at, hosts - 1)})
    elastic, restart = rows
    return {"benchmark": "elastic", "hosts": hosts, "steps": steps, "kill_at": kill_at,
            "checkpoint_every": checkpoint_every, "rows": rows,
            "speedup": restart["recovery_s"] / elastic["recovery_s"] if elastic["recovery_s"] else None,
            "speedup_back": restart["back_s"] / elastic["back_s"] if elastic["back_s"] else None}


def _timed(argv: list[str], kill_at: int, killed_rank: int) -> dict[str, Any]:
    """Run one contender; time its recovery from the arrival of the lines it prints."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,  # noqa: S603
                            env=dict(os.environ))
    lost_at: float | None = None
    reached = 0  # the highest step committed before the loss
    recovered_at = back_at = None
    first_after: int | None = None
    restarted = False  # the restart path's new attempt began: its steps are new, whatever their number
    summary: dict[str, Any] | None = None
    rank_recovery: float | None = None  # elastic: the new chief's own figure (its clock, failure to step)
    deadline = time.monotonic() + TIMEOUT_S
    assert proc.stdout is not None
    for raw in proc.stdout:
        now = time.monotonic()
        if now > deadline:
            proc.kill()
            raise DistrunError("bench elastic: a contender ran past its time limit")
        if not raw.startswith("{"):
            continue
        line = json.loads(raw)
        kind = line.get("type")
        if kind == "exited" and line.get("rank") == killed_rank and line.get("returncode") == -9 and lost_at is None:
            lost_at = now
        elif kind == "step" and lost_at is None:
            reached = max(reached, int(line["step"]))
        elif kind == "output" and "restarting every rank" in str(line.get("line")):
            restarted = True
        elif kind == "step" and lost_at is not None and (restarted or int(line["step"]) > reached):
            if recovered_at is None:
                recovered_at, first_after = now, int(line["step"])
            if back_at is None and int(line["step"]) > reached:
                back_at = now
        elif kind == "membership" and rank_recovery is None:
            rank_recovery = float(line["recovery_s"])
        elif kind == "summary":
            summary = line
    _, err = proc.communicate()
    if proc.returncode != 0 or summary is None or lost_at is None or recovered_at is None or back_at is None:
        tail = " | ".join(err.strip().splitlines()[-4:])
        raise DistrunError(f"bench elastic: {' '.join(argv[3:6])} ... did not recover as measured "
                           f"(exit {proc.returncode}): {tail}")
    assert first_after is not None
    return {"recovery_s": recovered_at - lost_at, "back_s": back_at - lost_at,
            "steps_redone": reached - (first_after - 1), "reached": reached,
            "restarts": summary["restarts"], "membership_changes": summary["membership_changes"],
            "steps_lost": summary["steps_lost"], "wall_s": summary["wall_s"], "rank_recovery_s": rank_recovery}
