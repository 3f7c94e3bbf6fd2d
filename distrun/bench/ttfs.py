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

Time to first step: from just before the command starts to the end of rank 0's
first step, both read from the wall clock (the hosts' clocks are assumed to
agree, as they do for namespaces of one machine; on real hosts, use NTP).
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

_STEPS = 5
_GLOBAL_BATCH = 64
_WARM_WAIT_S = 60.0


@dataclass(frozen=True)
class TtfsReport:
    world_size: int
    repeats: int
    rows: tuple[tuple[str, float], ...]  # (contender, median seconds to first step)
    where: str = "cluster"  # "cluster", or "local <device>"

    def speedup(self, name: str) -> float:
        """How many times faster than the cold torchrun ``name`` reaches its first step."""
        base = self.rows[0][1]
        value = next(seconds for contender, seconds in self.rows if contender == name)
        return base / value if value else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"benchmark": "ttfs", "where": self.where, "world_size": self.world_size, "repeats": self.repeats,
                "rows": [{"name": name, "time_to_first_step_s": seconds, "speedup_vs_torchrun": self.speedup(name)}
                         for name, seconds in self.rows]}


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
    on_cluster = [py, "-m", "distrun", "train", "--json", "--no-fetch", "--cluster", str(cluster),
                  "--strategy", "multi-worker"]
    world: dict[str, int] = {}

    def script() -> float:
        t0, out = run_command([*on_cluster, str(DDP_SCRIPT), "--", *script_args], env)
        world["size"] = int(next(o for o in out if o.get("type") == "job")["world_size"])  # type: ignore[arg-type]
        return float(measurement(out, "ddp")["first_step_time"]) - t0  # type: ignore[arg-type]

    def fit() -> float:
        t0, out = run_command([*on_cluster, "--steps", str(_STEPS), "--global-batch-size", str(_GLOBAL_BATCH), str(FIT_RECIPE)],
                       env)
        return _first_step_time(out) - t0

    def torchrun() -> float:
        t0, out = run_command([py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world['size']}",
                        str(DDP_SCRIPT), *script_args], env)
        return float(measurement(out, "ddp")["first_step_time"]) - t0  # type: ignore[arg-type]

    progress("warm-up: shipping the code, waiting for the warm interpreters")
    script()
    _wait_until_warm(cluster, env)
    contenders: dict[str, Callable[[], float]] = {
        "torchrun (cold)": torchrun, "distrun script (warm cluster)": script, "distrun fit (warm cluster)": fit}
    return TtfsReport(world["size"], repeats, _medians(contenders, repeats, progress))


def run_local_ttfs(*, replicas: int, device: str, repeats: int,
                   progress: Callable[[str], None] = lambda _: None) -> TtfsReport:
    """This machine: cold torchrun against cold and warm `distrun train` (``device``: cpu or cuda)."""
    py = sys.executable
    steps = ["--steps", str(_STEPS), "--global-batch-size", str(_GLOBAL_BATCH)]
    with tempfile.TemporaryDirectory(prefix="distrun-ttfs-") as home:
        env = {**os.environ, "DISTRUN_HOME": home}
        train = [py, "-m", "distrun", "train", "--json", "--strategy", "mirrored", "--replicas", str(replicas),
                 "--device", device]

        def distrun(recipe: Path, *, warm: bool) -> Callable[[], float]:
            fit = recipe == FIT_RECIPE
            argv = [*train, *([] if warm else ["--cold"]),
                    *([*steps, str(recipe)] if fit else [str(recipe), "--", *steps, "--device", device])]

            def measure() -> float:
                t0, out = run_command(argv, env)
                if out[-1].get("warm") is not warm:
                    raise DistrunError(f"a {'warm' if warm else 'cold'} run started {'cold' if warm else 'warm'}")
                first = _first_step_time(out) if fit else float(measurement(out, "ddp")["first_step_time"])  # type: ignore[arg-type]
                return first - t0
            return measure

        def torchrun() -> float:
            t0, out = run_command([py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={replicas}",
                                   str(DDP_SCRIPT), *steps, "--device", device], env)
            return float(measurement(out, "ddp")["first_step_time"]) - t0  # type: ignore[arg-type]

        progress("starting a local server in a temporary DISTRUN_HOME")
        run_command([py, "-m", "distrun", "up", "--json"], env)
        try:
            _wait_until_warm(None, env)
            contenders: dict[str, Callable[[], float]] = {
                "torchrun (cold)": torchrun,
                "distrun fit (cold)": distrun(FIT_RECIPE, warm=False),
                "distrun fit (warm)": distrun(FIT_RECIPE, warm=True),
                "distrun script (warm)": distrun(DDP_SCRIPT, warm=True),
            }
            rows = _medians(contenders, repeats, progress)
        finally:
            subprocess.run([py, "-m", "distrun", "down"], env=env, capture_output=True, timeout=120, check=False)  # noqa: S603
    return TtfsReport(replicas, repeats, rows, where=f"local {device}")


def _medians(contenders: dict[str, Callable[[], float]], repeats: int,
             progress: Callable[[str], None]) -> tuple[tuple[str, float], ...]:
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(repeats):
        for name, measure in contenders.items():  # interleaved, so drift hits all alike
            progress(f"round {i + 1}/{repeats}: {name}")
            runs[name].append(measure())
    return tuple((name, statistics.median(values)) for name, values in runs.items())
