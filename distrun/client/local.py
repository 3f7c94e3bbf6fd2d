"""Running a job on this machine: JobSpec in, events out, a JobSummary at the end.

The launcher runs in a background thread; events reach the caller through a
queue, so the caller's thread stays free to render and to receive Ctrl-C. The
cluster path (issue 4) will offer the same ``events()``/``result`` shape.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from distrun.client._debug_dir import debug_dir_of, sweep_stale_debug_dirs
from distrun.client._feed import EventFeed
from distrun.client._job_state import failure_message
from distrun.client._listing import Listing, list_on_local_server
from distrun.client._network import network_choice
from distrun.client._results import CHECKPOINT_NAME
from distrun.client._stop import by_whom
from distrun.client._tracker import JobTracker, tracker_settings
from distrun.client.diagnose import diagnose_launcher
from distrun.config import ClusterSpec, JobSpec, StrategyName
from distrun.errors import (
    CheckpointError,
    ConfigError,
    DistrunError,
    Interrupted,
    NonFiniteLoss,
    RecipeError,
    TrainingError,
)
from distrun.launch import LocalLauncher, ProcessState, RunResult, Starter, WorkerSpec
from distrun.protocol import SERVER_RANK, Diagnosed, Event, Failed, Hung, JobSnapshot, JobSummary, Output
from distrun.protocol.environment import JOB_SPEC_VAR

__all__ = ["LocalJob", "JobOutcome", "independent_ranks", "ELASTIC_RESPAWNS"]

_RUNS = itertools.count(1)

#: ``--elastic``: how many times each lost rank is started again to rejoin (torchrun's
#: ``--max-restarts`` bounds the same thing for its whole group).
ELASTIC_RESPAWNS = 3


def require_checkpoint(folder: str) -> None:
    """``--resume``: ``folder`` holds a published checkpoint (``ckpt-<step>.pt`` or ``ckpt-<step>/``), or a
    CheckpointError (exit 5) says what is there instead. Names only: torch reads it in the ranks."""
    path = Path(folder)
    if not path.is_dir():
        raise CheckpointError(f"--resume: {folder}: {'not a folder' if path.exists() else 'no such folder'}; "
                              "no checkpoint to resume from")
    if not any(CHECKPOINT_NAME.match(entry.name) for entry in path.iterdir()):
        raise CheckpointError(f"--resume: {folder}: no checkpoint to resume from (expected ckpt-<step>.pt or "
                              "ckpt-<step>/)")


@dataclass(frozen=True)
class JobOutcome:
    summary: JobSummary
    failure: Failed | None


class LocalJob:
    """One local training job. Use as a context manager; iterate ``events()``."""

    def __init__(self, spec: JobSpec, *, python: str | None = None, stop_grace_s: float = 5.0,
                 hang_timeout_s: float | None = None, starter: Starter | None = None,
                 list_on: ClusterSpec | None = None) -> None:
        """``starter``: how ranks start; None: fresh interpreters (cold). A warm local start
        passes the embedded server's zygote (``client.warm``); nothing else differs.
        ``list_on``: the embedded local cluster, whose server (if `distrun up` runs here) lists
        the job for `distrun jobs`, `logs`, `stacks` and `cancel` (``client/_listing``)."""
        if spec.checkpoint.resume and spec.checkpoint.dir:
            require_checkpoint(spec.checkpoint.dir)  # before any rank starts, not as "rank 1 failed at step 1"
        self.spec = spec
        self._t0 = time.time()
        sweep_stale_debug_dirs()  # what a killed `distrun train` of this user left
        run_id = (f"local-{time.strftime('%Y%m%d-%H%M%S', time.localtime(self._t0))}-{os.getpid()}"
                  f"-{next(_RUNS)}")  # unique in this process: a sweep's jobs may start in one second
        private, self._network_note = network_choice(spec)
        worker = WorkerSpec(
            argv=(python or sys.executable, "-m", "distrun.runtime"),
            local_world_size=spec.world_size,
            env={JOB_SPEC_VAR: spec.to_json(), **spec.extra_env},
            stop_grace_s=stop_grace_s,
            num_ps=spec.ps.tasks,
            independent_ranks=independent_ranks(spec),
            elastic=spec.strategy.elastic,
            respawns=ELASTIC_RESPAWNS if spec.strategy.elastic else 0,
            run_id=run_id,
            # The ranks' error files and a hang's Flight Recorder dumps; removed at the end when nothing was dumped.
            debug_dir=debug_dir_of(run_id),
            private_network=private,  # its store and gloo pairs out of other users' reach (launch/_netns)
        )
        self._feed = EventFeed(JobTracker(spec.recipe, spec.strategy.name.value, spec.trainer_ranks,
                                          started_at=self._t0, ps_tasks=spec.ps.tasks, **tracker_settings(spec)),
                               hang_timeout_s=hang_timeout_s, on_hang=self._on_hang, own_network=private)
        self.job_id = run_id
        self.listing: Listing | None = None
        self._launcher = LocalLauncher(worker, self._sink, starter=starter)
        if list_on is not None:  # last: nothing after it can fail and leave the listing open
            self.listing = list_on_local_server(list_on, run_id, {
                "recipe": Path(spec.recipe).name, "strategy": spec.strategy.name.value, "layout": spec.layout,
                "world_size": spec.world_size,
                "ps_tasks": spec.ps.tasks, "warm": starter is not None})
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="distrun-launcher", daemon=True)
        self._interrupted = False
        self._stop_reason: str | None = None  # stopped from elsewhere (`distrun cancel`): by whom

    def _sink(self, event: Event) -> None:
        """Every event of the job: to this process's view, and to the local server's record."""
        self._feed.put(event)
        if self.listing is not None:
            self.listing.put(event)

    def _on_hang(self, hang: Hung) -> None:
        """Every rank's stack and Flight Recorder, then (``--elastic``) the stuck rank is
        treated as lost (killed, the others go on, it rejoins)."""
        self._sink(self.diagnose("hang"))
        if self.spec.strategy.elastic and hang.rank >= 0:
            self._launcher.lose_rank(hang.rank, f"hung for {hang.stalled_s:.0f} s {hang.where}")

    def diagnose(self, reason: str = "asked", *, native: bool = False) -> Diagnosed:
        """Every running rank's stack, and its Flight Recorder dumped into the debug folder."""
        return diagnose_launcher(self._launcher, reason, native=native)

    def __enter__(self) -> LocalJob:
        if self.listing is not None:
            self.listing.start(stop=self._stopped_from_elsewhere, diagnose=self._diagnose_for_server)
        self._thread.start()
        return self

    def _stopped_from_elsewhere(self, reason: str) -> None:
        """`distrun cancel` from another terminal: stop as Ctrl-C does, and say who did."""
        self._stop_reason = self._stop_reason or reason
        self._launcher.stop(reason)

    def _diagnose_for_server(self, native: bool, flight_recorder: bool) -> dict[str, object]:
        """`distrun stacks` from another terminal: this process runs py-spy on its ranks (the
        tracer they allow), as a worker server does for a cluster job's."""
        host = self.listing.host if self.listing is not None else "localhost"
        return self._launcher.diagnosis(native=native, flight_recorder=flight_recorder, host=host)

    def __exit__(self, *exc: object) -> None:
        self.cancel("client exiting")
        self._thread.join()

    def _run(self) -> None:
        if self._network_note:
            self._sink(Output(rank=SERVER_RANK, time=time.time(), stream="stderr", line=f"[distrun] {self._network_note}"))
        try:
            self._result = self._launcher.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self._error = exc
        finally:
            if self.listing is not None:
                self.listing.end(self._listed_result())
            self._feed.end()

    def _listed_result(self) -> dict[str, object]:
        """The end as the local server records it (a cluster host's shape)."""
        result = self._result
        if result is None:
            return {"state": "failed", "failure": None, "error": f"the launcher failed: {self._error}"}
        return result.record(warm=self._launcher.warm, reason=self._stop_reason or by_whom("interrupted"))

    def events(self, poll_s: float = 0.25) -> Iterator[Event | None]:
        """Yield events as they come; ``None`` every ``poll_s`` without one (for redraws)."""
        return self._feed.events(poll_s)

    def snapshot(self) -> JobSnapshot:
        return self._feed.snapshot()

    def summary(self, status: str, error: str | None = None) -> JobSummary:
        summary = self._feed.summary(status, error)  # its reason: a callback that ended the run early
        return dataclasses.replace(summary, warm=self._launcher.warm,
                                   reason=self._stop_reason if status == "interrupted" else summary.reason)

    def cancel(self, reason: str = "cancelled", *, interrupted: bool = False) -> None:
        self._interrupted = self._interrupted or interrupted
        self._launcher.stop(reason)

    def outcome(self) -> JobOutcome:
        """Wait for the end; raise the DistrunError that describes a failure."""
        self._thread.join()
        if self._error is not None:
            if isinstance(self._error, DistrunError):
                raise self._error
            raise DistrunError(f"launcher failed: {self._error}") from self._error
        result = self._result
        if result is None:
            raise DistrunError("launcher ended without a result")
        if result.state is ProcessState.SUCCEEDED:
            return JobOutcome(dataclasses.replace(self.summary("succeeded"), ranks_lost=list(result.lost)), None)
        if result.state is ProcessState.STOPPED or self._interrupted:
            what = (f"{self.spec.trainer_ranks} rank(s)" if self.spec.parallel.ranks_per_replica > 1
                    else f"{self.spec.strategy.replicas} replica(s)")
            why = f" ({self._stop_reason})" if self._stop_reason else ""
            raise Interrupted(f"interrupted: stopped {what}{why}")
        failure = result.failure
        message = failure_message(failure)
        detail = failure.traceback if failure else None
        error_class = ERROR_BY_KIND.get(failure.kind) if failure else None
        if error_class is not None:
            raise error_class(message, detail=detail)
        rank = failure.rank if failure else None
        raise TrainingError(message, rank=rank, detail=detail, stderr_tail=self._feed.stderr_tail(rank))


def independent_ranks(spec: JobSpec) -> frozenset[int]:
    """Ranks whose failure stops no one: parameter-server workers other than the chief.

    The chief hosts the rendezvous store and writes checkpoints, and the ps tasks
    hold the only copy of the parameters: their failure ends (or restarts) the job.
    """
    if spec.strategy.name is not StrategyName.PARAMETER_SERVER:
        return frozenset()
    return frozenset(range(1, spec.strategy.replicas))


#: Failed.kind -> the error (and exit code) it means; anything else is a TrainingError.
ERROR_BY_KIND: dict[str, type[DistrunError]] = {
    "import": RecipeError,  # the recipe's top level raised (ImportError, NameError, ...)
    "RecipeError": RecipeError,
    "ConfigError": ConfigError,
    "CheckpointError": CheckpointError,
    "NonFiniteLoss": NonFiniteLoss,
}


