"""`distrun bench straggler`: asynchronous against synchronous training with one slow worker.

``workers`` workers train the same recipe under ``--strategy parameter-server``,
once asynchronously and once in synchronous rounds (``--ps-sync``, the same
transport, so only the update rule differs). One worker is ``slow_factor`` (k)
times slower than the others (an injected sleep). A synchronous round waits for
the straggler; asynchronous workers do not, so with n workers

    bound = async / sync throughput = ((n - 1) + 1/k) / (n / k)

(n = 3, k = 3: 2.33x). The report gives the measured ratio as a fraction of
that bound, and for each mode the updates and seconds needed to reach a target
loss (asynchronous gradients are stale, so they may need more updates).
Throughput counts worker batches per second: an asynchronous update is one
batch, a synchronous round is n.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from distrun.bench._runs import HERE, run_command

__all__ = ["StragglerReport", "ModeResult", "run_straggler", "straggler_bound"]

RECIPE = HERE / "_straggler_recipe.py"


def straggler_bound(workers: int, slow_factor: float) -> float:
    return ((workers - 1) + 1 / slow_factor) / (workers / slow_factor)


@dataclass(frozen=True)
class ModeResult:
    mode: str
    batches_per_s: float
    updates: int
    batches_to_target: int | None
    seconds_to_target: float | None
    final_loss: float | None


@dataclass(frozen=True)
class StragglerReport:
    workers: int
    slow_factor: float
    step_s: float
    target_loss: float
    rows: tuple[ModeResult, ...]

    @property
    def bound(self) -> float:
        return straggler_bound(self.workers, self.slow_factor)

    @property
    def ratio(self) -> float:
        sync = next(r for r in self.rows if r.mode == "sync")
        asynchronous = next(r for r in self.rows if r.mode == "async")
        return asynchronous.batches_per_s / sync.batches_per_s if sync.batches_per_s else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "benchmark": "straggler",
            "workers": self.workers,
            "slow_factor": self.slow_factor,
            "step_s": self.step_s,
            "target_loss": self.target_loss,
            "bound": self.bound,
            "ratio": self.ratio,
            "fraction_of_bound": self.ratio / self.bound,
            "rows": [r.__dict__ for r in self.rows],
        }


def run_straggler(*, workers: int, slow_factor: float, step_s: float, steps: int, target_loss: float,
                  progress: Callable[[str], None] = lambda _msg: None) -> StragglerReport:
    rows = []
    for mode in ("sync", "async"):
        progress(f"{mode}: {workers} workers, one {slow_factor:g}x slower")
        rows.append(_run_mode(mode, workers, slow_factor, step_s, steps, target_loss))
    return StragglerReport(workers, slow_factor, step_s, target_loss, tuple(rows))


def _run_mode(mode: str, workers: int, slow_factor: float, step_s: float, steps: int,
              target_loss: float) -> ModeResult:
    # Each update in rounds is `workers` batches: give both modes the same number of batches.
    updates = steps // workers if mode == "sync" else steps
    argv = [sys.executable, "-m", "distrun", "train", str(RECIPE), "--strategy", "parameter-server",
            "--replicas", str(workers), "--device", "cpu", "--steps", str(updates), "--log-interval-s", "0", "--json",
            *(["--ps-sync"] if mode == "sync" else []),
            "--", "--step-s", str(step_s), "--slow-rank", "1", "--slow-factor", str(slow_factor)]
    _t0, lines = run_command(argv, dict(os.environ))
    steps_seen = sorted((line for line in lines if line.get("type") == "step"), key=lambda s: float(s["time"]))  # type: ignore[arg-type]
    # Throughput between the first and the last update any worker saw (every step is reported).
    batches_per_update = workers if mode == "sync" else 1
    rate = 0.0
    if len(steps_seen) > 1:
        first, last = steps_seen[0], steps_seen[-1]
        span_s = float(last["time"]) - float(first["time"])  # type: ignore[arg-type]
        if span_s > 0:
            rate = (int(last["step"]) - int(first["step"])) * batches_per_update / span_s  # type: ignore[arg-type]
    # Both modes average the loss over the same number of worker batches (2 per worker).
    reached = _first_below(steps_seen, target_loss, window=2 if mode == "sync" else 2 * workers)
    start = float(steps_seen[0]["time"]) if steps_seen else 0.0  # type: ignore[arg-type]
    summary = lines[-1]
    return ModeResult(
        mode=mode,
        batches_per_s=rate,
        updates=int(summary.get("steps", 0)),  # type: ignore[arg-type]
        batches_to_target=int(reached["step"]) * batches_per_update if reached else None,  # type: ignore[arg-type]
        seconds_to_target=float(reached["time"]) - start if reached else None,  # type: ignore[arg-type]
        final_loss=summary.get("final_loss"),  # type: ignore[arg-type]
    )


def _first_below(steps: list[dict[str, object]], target: float, window: int) -> dict[str, object] | None:
    """The first step event at which the training loss, averaged per step and then over the
    last ``window`` steps, is below ``target``. Per step first, so the order in which workers'
    events arrive cannot change the answer."""
    by_step: dict[int, list[float]] = {}
    first_seen: dict[int, dict[str, object]] = {}
    for line in steps:
        if line.get("loss") is None:
            continue
        step = int(line["step"])  # type: ignore[arg-type]
        by_step.setdefault(step, []).append(float(line["loss"]))  # type: ignore[arg-type]
        first_seen.setdefault(step, line)
    recent: list[float] = []
    for step in sorted(by_step):
        recent = (recent + [sum(by_step[step]) / len(by_step[step])])[-window:]
        if len(recent) == window and sum(recent) / window < target:
            return first_seen[step]
    return None
