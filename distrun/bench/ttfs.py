"""`distrun bench ttfs --cluster FILE`: time to first step on a warm cluster against a cold torchrun.

Three contenders, each started as a fresh command, as a user would type it, in
one run (interleaved, median of ``repeats``):

* ``torchrun (cold)``: ``torchrun --standalone --nproc_per_node=N`` of the
  hand-written DDP script on this machine: a new interpreter per rank, torch
  imported by each;
* ``distrun script (warm cluster)``: ``distrun train`` of the very same script
  with ``--cluster FILE --strategy multi-worker``: code shipped, ranks forked
  from each server's warm interpreter;
* ``distrun fit (warm cluster)``: the fit-style recipe of the same model.

Each runs one step. Time to first step: from just before the command starts to
the end of rank 0's first step, both read from the wall clock (the hosts' clocks
are assumed to agree, as they do for namespaces of one machine; on real hosts,
use NTP). Wall: from just before the command starts to its exit, all of a
1-step job as a user waits for it (on a cluster: its results home, the summary).
N is the cluster's world size, so both sides start the same number of ranks.

Without ``--cluster`` (``run_local_ttfs``) everything runs on this machine, on
its default device, N ranks each: torchrun (cold) against ``distrun train`` of
the fit recipe, ``--cold`` and warm (forked from the embedded server's warm
interpreter), and the script warm. The benchmark starts its own embedded
server in a temporary ``DISTRUN_HOME`` and stops it at the end, so a server the
user keeps is neither used nor disturbed.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distrun.bench._runs import DDP_SCRIPT, FIT_RECIPE, measurement, run_command
from distrun.errors import DistrunError

__all__ = ["TtfsReport", "run_ttfs", "run_local_ttfs"]

_STEPS = 1
_GLOBAL_BATCH = 64
_WARM_WAIT_S = 60.0


@dataclass(frozen=True)
class TtfsReport:
    world_size: int
    repeats: int
    rows: tuple[tuple[str, float, float], ...]  # (contender, median seconds to first step, median wall seconds)
    where: str = "cluster"  # "cluster", or "local <device>"

    def speedup(self, name: str, *, wall: bool = False) -> float:
        """How many times sooner than the cold torchrun ``name`` reaches its first step (``wall``: ends)."""
        column = 2 if wall else 1
        base = self.rows[0][column]
        value = next(row[column] for row in self.rows if row[0] == name)
        return base / value if value else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"benchmark": "ttfs", "where": self.where, "world_size": self.world_size, "repeats": self.repeats,
                "steps": _STEPS,
                "rows": [{"name": name, "time_to_first_step_s": seconds, "speedup_vs_torchrun": self.speedup(name),
                          "wall_s": wall, "wall_speedup_vs_torchrun": self.speedup(name, wall=True)}
                         for name, seconds, wall in self.rows]}


def _first_step_time(objects: list[dict[str, object]]) -> float:
    for obj in objects:
        if obj.get("type") == "step" and obj.get("rank") == 0:
            return float(obj["time"])  # type: ignore[arg-type]
    raise DistrunError("the distrun run reported no step")


def _wait_until_warm(cluster: Path | None, env: dict[str, str]) -> None:
    """Wait until every server's warm interpreter is ready (it imports torch after `up`)."""
    deadline = time.monotonic() + _WARM_WAIT_S
    where = [str(cluster)] if cluster is not None else []
    while True:
        _, out = run_command([sys.executable, "-m", "distrun", "status", *where, "--json"], env)
        hosts = out[-1]["hosts"] if out else []
        if hosts and all(row.get("server") and row["server"].get("warm") for row in hosts):  # type: ignore[index, union-attr]
            return
        if time.monotonic() > deadline:
            raise DistrunError(f"the servers of {cluster or 'this machine'} have no warm interpreter after "
                               f"{_WARM_WAIT_S:.0f} s")
        time.sleep(0.5)


def run_ttfs(*, cluster: Path, repeats: int, progress: Callable[[str], None] = lambda _: None) -> TtfsReport:
    py = sys.executable
    env = dict(os.environ)
    script_args = ["--steps", str(_STEPS), "--global-batch-size", str(_GLOBAL_BATCH)]
    # Results come home as a user's job's do (the summary; no checkpoint here), into a folder of the benchmark's.
    results = tempfile.mkdtemp(prefix="distrun-ttfs-results-")
    on_cluster = [py, "-m", "distrun", "train", "--json", "--results-dir", results, "--cluster", str(cluster),
                  "--strategy", "multi-worker"]
    world: dict[str, int] = {}

    def script() -> tuple[float, float]:
        t0, out = run_command([*on_cluster, str(DDP_SCRIPT), "--", *script_args], env)
        wall = time.time() - t0
        world["size"] = int(next(o for o in out if o.get("type") == "job")["world_size"])  # type: ignore[arg-type]
        return float(measurement(out, "ddp")["first_step_time"]) - t0, wall  # type: ignore[arg-type]

    def fit() -> tuple[float, float]:
        t0, out = run_command([*on_cluster, "--steps", str(_STEPS), "--global-batch-size", str(_GLOBAL_BATCH), str(FIT_RECIPE)],
                       env)
        return _first_step_time(out) - t0, time.time() - t0

    def torchrun() -> tuple[float, float]:
        t0, out = run_command([py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world['size']}",
                        str(DDP_SCRIPT), *script_args], env)
        wall = time.time() - t0
        return float(measurement(out, "ddp")["first_step_time"]) - t0, wall  # type: ignore[arg-type]

    try:
        progress("warm-up: shipping the code, waiting for the warm interpreters")
        script()
        _wait_until_warm(cluster, env)
        contenders: dict[str, Callable[[], tuple[float, float]]] = {
            "torchrun (cold)": torchrun, "distrun script (warm cluster)": script, "distrun fit (warm cluster)": fit}
        return TtfsReport(world["size"], repeats, _medians(contenders, repeats, progress))
    finally:
        shutil.rmtree(results, ignore_errors=True)


def run_local_ttfs(*, replicas: int, device: str, repeats: int,
                   progress: Callable[[str], None] = lambda _: None) -> TtfsReport:
    """This machine: cold torchrun against cold and warm `distrun train` (``device``: cpu or cuda)."""
    py = sys.executable
    steps = ["--steps", str(_STEPS), "--global-batch-size", str(_GLOBAL_BATCH)]
    with tempfile.TemporaryDirectory(prefix="distrun-ttfs-") as home:
        env = {**os.environ, "DISTRUN_HOME": home}
        train = [py, "-m", "distrun", "train", "--json", "--strategy", "mirrored", "--replicas", str(replicas),
                 "--device", device]

        def distrun(recipe: Path, *, warm: bool) -> Callable[[], tuple[float, float]]:
            fit = recipe == FIT_RECIPE
            argv = [*train, *([] if warm else ["--cold"]),
                    *([*steps, str(recipe)] if fit else [str(recipe), "--", *steps, "--device", device])]

            def measure() -> tuple[float, float]:
                t0, out = run_command(argv, env)
                wall = time.time() - t0
                if out[-1].get("warm") is not warm:
                    raise DistrunError(f"a {'warm' if warm else 'cold'} run started {'cold' if warm else 'warm'}")
                first = _first_step_time(out) if fit else float(measurement(out, "ddp")["first_step_time"])  # type: ignore[arg-type]
                return first - t0, wall
            return measure

        def torchrun() -> tuple[float, float]:
            t0, out = run_command([py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={replicas}",
                                   str(DDP_SCRIPT), *steps, "--device", device], env)
            wall = time.time() - t0
            return float(measurement(out, "ddp")["first_step_time"]) - t0, wall  # type: ignore[arg-type]

        progress("starting a local server in a temporary DISTRUN_HOME")
        run_command([py, "-m", "distrun", "up", "--json"], env)
        try:
            _wait_until_warm(None, env)
            contenders: dict[str, Callable[[], tuple[float, float]]] = {
                "torchrun (cold)": torchrun,
                "distrun fit (cold)": distrun(FIT_RECIPE, warm=False),
                "distrun fit (warm)": distrun(FIT_RECIPE, warm=True),
                "distrun script (warm)": distrun(DDP_SCRIPT, warm=True),
            }
            rows = _medians(contenders, repeats, progress)
        finally:
            subprocess.run([py, "-m", "distrun", "down"], env=env, capture_output=True, timeout=120, check=False)  # noqa: S603
    return TtfsReport(replicas, repeats, rows, where=f"local {device}")


def _medians(contenders: dict[str, Callable[[], tuple[float, float]]], repeats: int,
             progress: Callable[[str], None]) -> tuple[tuple[str, float, float], ...]:
    """Each contender's median time to first step and median wall, over ``repeats`` interleaved rounds."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for i in range(repeats):
        for name, measure in contenders.items():  # interleaved, so drift hits all alike
            progress(f"round {i + 1}/{repeats}: {name}")
            runs[name].append(measure())
    return tuple((name, statistics.median(v[0] for v in values), statistics.median(v[1] for v in values))
                 for name, values in runs.items())
