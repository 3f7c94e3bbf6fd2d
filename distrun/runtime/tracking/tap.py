"""``--tracker mlflow|wandb``: rank 0's events, logged to experiment trackers as they pass.

A tap on rank 0's event writer, as ``--tensorboard``'s is: every event goes on to the
launcher unchanged, and what the live view shows is also logged, under the names
TensorBoard gets (docs/tracking.md). No recipe changes, and only rank 0 logs, so a job is
one run in each tracker however many ranks it has.

- At start: the run's parameters (``RunParams``), on the training thread, so that a
  tracker that cannot start fails the job at once with one line.
- Each Step, Log, Eval and MembershipChanged: metrics at the event's step.
- Done: the summary (steps, final_loss, samples_per_s, peak_mem_mb).
- At exit (``close``, an atexit handler; a job ends through ``_exit``, which runs them): the
  newest checkpoint rank 0 reported, when ``--tracker-checkpoint`` asked for it and the job
  is done; then each run ends as finished. Logged at exit rather than at Done because a
  custom loop's last ``--async-checkpoint`` is reported by ``strategy.close()``, after Done.
- Failed: each run ends as failed before the event goes on (the launcher answers a Failed
  event with SIGTERM to every rank, and the process leaves with ``os._exit``, which runs no
  atexit handler). SIGTERM itself (another rank failed, the job was cancelled) ends the runs
  as failed too, when Python gets to run the handler (``end_runs_on_sigterm``).

Tracker calls after the start run on their own thread (``_calls``): a slow or failing
tracker never slows or stops training.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from distrun.config import JobSpec
from distrun.errors import ConfigError
from distrun.protocol import Checkpointed, Done, Eval, Event, Failed, Log, MembershipChanged, Step
from distrun.runtime.tracking._calls import TrackerCalls, note, one_line
from distrun.runtime.tracking.api import RunParams, Tracker

__all__ = ["TrackerTap", "tracker_tap", "FINISH_WAIT_S", "FAILED_WAIT_S", "SIGTERM_WAIT_S"]

#: At exit, how long rank 0 waits for queued calls, the checkpoint's upload included.
FINISH_WAIT_S = 600.0
#: After rank 0's failure, how long the Failed event waits for the runs to be marked failed.
FAILED_WAIT_S = 10.0
#: Stopped by the launcher: how long to mark the runs failed (its grace before SIGKILL is 5 s).
SIGTERM_WAIT_S = 3.0


class TrackerTap:
    """Wraps an EventWriter (or another tap): ``emit`` sends the event on, then logs it."""

    def __init__(self, writer: Any, trackers: Sequence[Tracker], params: RunParams, *,
                 log_checkpoint: bool = False) -> None:
        self._writer = writer
        self._trackers = tuple(trackers)
        self._log_checkpoint = log_checkpoint
        self._learning_rate: Any = None
        self._learning_rate_failed = False  # its first failure is reported; the rest are not
        self._checkpoint: tuple[int, str] | None = None  # (step, path) of the newest one reported
        self._done = False
        self._finished = False
        _start(self._trackers, params)
        self._calls = TrackerCalls()

    @property
    def learning_rate(self) -> Any:
        """A callable the fit loop sets (the optimizer's current lr), read at each Step."""
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, source: Any) -> None:
        self._learning_rate = source
        if hasattr(self._writer, "learning_rate"):  # taps stack: TrackerTap(TensorBoardTap(EventWriter))
            self._writer.learning_rate = source

    def emit(self, event: Event) -> None:
        if isinstance(event, Failed) and not self._finished:
            # Before the event goes on: the launcher stops every rank (SIGTERM) as soon as it hears.
            self._finish(failed=True, wait_s=FAILED_WAIT_S)
        self._writer.emit(event)
        if self._finished:
            return
        if isinstance(event, Checkpointed):
            if self._checkpoint is None or event.step >= self._checkpoint[0]:
                self._checkpoint = (event.step, event.path)
        elif isinstance(event, Done):
            self._done = True
            self._each("log_summary", _summary(event))
        else:
            learning_rate = self._current_learning_rate() if isinstance(event, Step) else None
            for step, metrics in _metrics(event, learning_rate).items():
                if metrics:
                    self._each("log_metrics", step, metrics, event.time)

    def _current_learning_rate(self) -> float | None:
        """The optimizer's lr now, or None. A lookup that fails would fail every step, so the first
        failure is reported (the chart's missing line has a reason) and the step's other figures go on."""
        if self._learning_rate is None:
            return None
        try:
            return float(self._learning_rate())
        except Exception as exc:  # noqa: BLE001 - a missing learning rate never costs the step's figures
            if not self._learning_rate_failed:
                self._learning_rate_failed = True
                names = ", ".join(tracker.name for tracker in self._trackers)
                note(f"--tracker {names}: reading the learning rate failed ({type(exc).__name__}: {one_line(exc)}); "
                     "train/learning_rate is not logged while it fails, later failures are not shown")
            return None

    def end_runs_on_sigterm(self) -> None:
        """The launcher stops rank 0 with SIGTERM (another rank failed, the job was cancelled):
        end each run as failed within the launcher's grace before SIGKILL, then die of the
        signal as before. Python runs the handler once the main thread is back in Python (a
        collective stuck in C keeps it out; SIGKILL then ends the process, the run unended)."""
        previous = signal.getsignal(signal.SIGTERM)

        def stopped(signum: int, frame: Any) -> None:
            if not self._finished:
                self._finish(failed=True, wait_s=SIGTERM_WAIT_S)
            else:  # a finish already queued (rank 0's own failure): let it reach the trackers
                self._calls.drain(SIGTERM_WAIT_S)
            if callable(previous):
                previous(signum, frame)
                return
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, stopped)

    def close(self) -> None:
        """The process is leaving: log the checkpoint (when asked for), then end each run."""
        if self._finished:
            return
        if self._log_checkpoint and self._done:
            if self._checkpoint is None:
                note("--tracker-checkpoint: rank 0 reported no checkpoint; none logged")
            else:
                self._each("log_artifact", self._checkpoint[1])
        self._finish(failed=False, wait_s=FINISH_WAIT_S)

    def _finish(self, *, failed: bool, wait_s: float) -> None:
        self._finished = True
        self._each("finish", failed)
        if not self._calls.drain(wait_s):
            names = ", ".join(tracker.name for tracker in self._trackers)
            note(f"--tracker {names}: still busy after {wait_s:.0f} s; the run may be incomplete")

    def _each(self, method: str, *args: Any) -> None:
        """Queue ``tracker.<method>(*args)`` for every tracker (per-step metrics may be dropped
        while a tracker is far behind; nothing else is)."""
        for tracker in self._trackers:
            self._calls.submit(tracker.name, method, getattr(tracker, method), *args,
                               droppable=method == "log_metrics")


def _start(trackers: Sequence[Tracker], params: RunParams) -> None:
    """Start every run, or none: a tracker that cannot start ends those already started."""
    started: list[Tracker] = []
    try:
        for tracker in trackers:
            tracker.start(params)
            started.append(tracker)
    except ConfigError:
        for tracker in started:
            try:
                tracker.finish(failed=True)
            except Exception:  # noqa: BLE001, S110 - the first tracker's error is the one to report
                pass
        raise


def _metrics(event: Event, learning_rate: float | None) -> dict[int, dict[str, float]]:
    """The event's figures by step, under TensorBoard's names ({} for events without any);
    ``learning_rate``: a Step's, when known."""
    if isinstance(event, Step):
        found = {"train/samples_per_s": float(event.samples_per_s)}
        if event.loss is not None:
            found["train/loss"] = float(event.loss)
        if learning_rate is not None:
            found["train/learning_rate"] = learning_rate
        return {event.step: found}
    if isinstance(event, Log):
        return {event.step: {name: float(value) for name, value in event.scalars.items()}} if event.scalars else {}
    if isinstance(event, Eval):
        return {event.step: {f"eval/{name}": float(value) for name, value in event.metrics.items()}}
    if isinstance(event, MembershipChanged):
        return {event.step + 1: {"membership/world_size": float(event.world_size)}}
    return {}


def _summary(event: Done) -> Mapping[str, float]:
    figures = {"steps": event.steps, "final_loss": event.final_loss, "samples_per_s": event.samples_per_s,
               "peak_mem_mb": event.peak_mem_mb}
    return {name: float(value) for name, value in figures.items() if value is not None}


def tracker_tap(writer: Any, spec: JobSpec, *, world_size: int, tf_config: str | None) -> TrackerTap:
    """Rank 0's tap for ``spec.observe.trackers``: each tracker pointed at its ``--tracker-uri``."""
    from distrun.runtime.tracking._mlflow import MlflowTracker
    from distrun.runtime.tracking._wandb import WandbTracker

    makers = {"mlflow": MlflowTracker, "wandb": WandbTracker}
    observe = spec.observe
    trackers = [makers[name](observe.tracker_uris.get(name), observe.experiment, observe.run_name)
                for name in observe.trackers]
    params = RunParams.from_spec(spec, world_size=world_size, tf_config=tf_config)
    return TrackerTap(writer, trackers, params, log_checkpoint=observe.tracker_checkpoint)
