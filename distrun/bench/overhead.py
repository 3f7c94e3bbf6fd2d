"""`distrun bench overhead`: distrun's cost against hand-written torchrun + DDP.

Three contenders train the same model on the same data for the same steps, in
one run, each as a fresh command as a user would start it:

* ``torchrun+ddp``: ``torchrun --standalone --nproc_per_node=N`` of a
  hand-written DDP script (the baseline);
* ``distrun fit``: ``distrun train`` of the fit-style recipe, ``--strategy mirrored``;
* ``distrun script``: ``distrun train`` of the very same hand-written script.

Each is run ``repeats`` times in turn and the median is kept. Time to first
step is measured from just before the command starts to the end of rank 0's
first step (wall clock, same machine).
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

from distrun.bench._runs import DDP_SCRIPT, FIT_RECIPE, measurement, run_command

__all__ = ["Measurement", "OverheadReport", "run_overhead"]



@dataclass(frozen=True)
class Measurement:
    name: str
    samples_per_s: float
    time_to_first_step_s: float


@dataclass(frozen=True)
class OverheadReport:
    replicas: int
    steps: int
    global_batch_size: int
    repeats: int
    rows: tuple[Measurement, ...]

    def ratio(self, name: str) -> float:
        """Throughput of ``name`` over the baseline's (1.0 = no overhead)."""
        base = self.rows[0].samples_per_s
        row = next(r for r in self.rows if r.name == name)
        return row.samples_per_s / base if base else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "benchmark": "overhead",
            "replicas": self.replicas,
            "steps": self.steps,
            "global_batch_size": self.global_batch_size,
            "repeats": self.repeats,
            "rows": [
                {"name": r.name, "samples_per_s": r.samples_per_s, "time_to_first_step_s": r.time_to_first_step_s,
                 "vs_ddp": self.ratio(r.name)}
                for r in self.rows
            ],
        }


def run_overhead(
    *, replicas: int, steps: int, global_batch_size: int, repeats: int,
    progress: Callable[[str], None] = lambda _: None,
) -> OverheadReport:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // replicas)))
    py = sys.executable
    script_args = ["--steps", str(steps), "--global-batch-size", str(global_batch_size)]
    # A CPU benchmark everywhere: on a GPU machine --device auto would otherwise ask for N GPUs.
    distrun = [py, "-m", "distrun", "train", "--json", "--strategy", "mirrored", "--replicas", str(replicas),
               "--device", "cpu"]
    def ddp() -> Measurement:
        t0, out = run_command([py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={replicas}",
                        str(DDP_SCRIPT), *script_args], env)
        m = measurement(out, "ddp")
        return Measurement("torchrun+ddp", float(m["samples_per_s"]), float(m["first_step_time"]) - t0)

    def fit() -> Measurement:
        _, out = run_command([*distrun, "--steps", str(steps), "--global-batch-size", str(global_batch_size), str(FIT_RECIPE)], env)
        summary = out[-1]
        return Measurement("distrun fit", float(summary["samples_per_s"]), float(summary["time_to_first_step_s"]))

    def script() -> Measurement:
        t0, out = run_command([*distrun, str(DDP_SCRIPT), "--", *script_args], env)
        m = measurement(out, "ddp")
        return Measurement("distrun script", float(m["samples_per_s"]), float(m["first_step_time"]) - t0)

    contenders: dict[str, Callable[[], Measurement]] = {"torchrun+ddp": ddp, "distrun fit": fit, "distrun script": script}
    runs: dict[str, list[Measurement]] = {name: [] for name in contenders}
    for i in range(repeats):
        for name, measure in contenders.items():  # interleaved, so drift hits all alike
            progress(f"round {i + 1}/{repeats}: {name}")
            runs[name].append(measure())
    rows = tuple(
        Measurement(
            name,
            statistics.median(m.samples_per_s for m in ms),
            statistics.median(m.time_to_first_step_s for m in ms),
        )
        for name, ms in runs.items()
    )
    return OverheadReport(replicas, steps, global_batch_size, repeats, rows)
