"""One job as its page shows it: followed once, whatever the number of open pages.

A watch attaches to the job as `distrun attach` does (``ClusterJob.attach``: the servers'
event logs replayed from the start, then followed), so a finished job's page is rebuilt from
the same record, and a running job's is pushed from the same streams the live table reads.
It keeps what the page draws (the rank rows, one chart point per chief step, the output
lines) in lists that only grow; each page reads them from its own cursor, so a slow page
slows no one and no queue per page is needed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from distrun.errors import DistrunError
from distrun.dashboard._timeline import timeline_entry
from distrun.protocol import SERVER_RANK, Eval, Event, JobSnapshot, Output, ReplicaStatus, Step

__all__ = ["Followed", "JobWatch", "Cursor", "Update", "MAX_LINES", "MAX_POINTS", "RESTART_WAIT_S", "wait_pct"]

#: Output lines a watch keeps (the oldest go first): a page shows the tail, `distrun logs` has all.
MAX_LINES = 20_000
#: Chart points a watch keeps; past it every other old point goes, so a long run keeps its shape.
MAX_POINTS = 4_000
#: How often the rank table is refreshed while events arrive.
_ROWS_EVERY_S = 0.5
#: How long after a failed attempt the watch looks for the ``--max-restarts`` attempt after it.
RESTART_WAIT_S = 20.0


@dataclass(frozen=True)
class Cursor:
    """How far a page has read: versions of the head and the rows, the chart's epoch (bumped when it
    is thinned: the page redraws it whole) and its point count, and the next output line's index."""

    head: int = -1
    rows: int = -1
    epoch: int = -1
    points: int = 0
    line: int = 0
    events: int = 0
    evals: int = 0


@dataclass(frozen=True)
class Update:
    """What a page has not seen yet; ``reset``: drop what it has (its first read, or a thinned chart)."""

    reset: bool
    head: dict[str, Any]
    rows: list[dict[str, Any]] | None
    points: list[dict[str, Any]]
    lines: list[dict[str, Any]]
    events: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    cursor: Cursor

    def to_dict(self) -> dict[str, Any]:
        return {"reset": self.reset, "head": self.head, "rows": self.rows, "points": self.points, "lines": self.lines,
                "events": self.events, "evals": self.evals}


class Followed(Protocol):
    """What a watch follows: a job attached on its servers (``ClusterJob.attach``), or one read back
    from the history `down` kept (``dashboard/_kept``)."""

    def events(self, poll_s: float = 0.25) -> Iterator[Event | None]: ...

    def snapshot(self) -> JobSnapshot: ...

    def host_of_rank(self, rank: int) -> str: ...

    def cancel(self, reason: str = "cancelled", *, interrupted: bool = False) -> None: ...

    def close(self) -> None: ...


class JobWatch:
    """Follows ``job_id`` in a thread, ``attach(job_id)`` giving what to follow; ``read(cursor)`` gives
    a page what is new. ``final_state(job_id)`` is asked once the follow ends: the state and reason
    the servers recorded; ``label``: the cluster's name as the pages show it (``local``)."""

    def __init__(self, attach: Callable[[str], Followed], job_id: str,
                 final_state: Callable[[str], tuple[str, str | None]], label: str = "",
                 listed: Callable[[str], bool] | None = None, restart_wait_s: float = RESTART_WAIT_S) -> None:
        self.job_id = job_id
        self._restart_wait_s = restart_wait_s
        self._listed = listed  # whether a job id is listed now; None: no attempt ever follows (a local job)
        self._attach = attach
        self._final_state = final_state
        self._changed = threading.Condition()
        self._job: Followed | None = None
        self._closing = False
        self._head: dict[str, Any] = {"job": job_id, "cluster": label, "state": "connecting", "reason": None, "recipe": "",
                                      "strategy": "", "step": 0, "total_steps": None, "loss": None,
                                      "samples_per_s": 0.0, "hosts": [], "elapsed_s": 0.0, "ended": False,
                                      "attempts": 1}
        self._head_version = 0
        self._rows: list[dict[str, Any]] = []
        self._rows_version = 0
        self._points: list[dict[str, Any]] = []
        self._points_epoch = 0  # bumped when the chart is thinned: pages redraw it whole
        self._lines: list[dict[str, Any]] = []
        self._lines_base = 0  # the absolute index of self._lines[0]
        self._events: list[dict[str, Any]] = []  # the timeline (``_timeline``): few, all kept
        self._evals: list[dict[str, Any]] = []  # each evaluation's step and metrics, for their charts
        self._waits: dict[int, float | None] = {}  # rank -> its newest Step's wait share, in percent
        self._thread = threading.Thread(target=self._run, name=f"dashboard-watch-{job_id}", daemon=True)

    def start(self) -> JobWatch:
        self._thread.start()
        return self

    @property
    def ended(self) -> bool:
        return bool(self._head["ended"])

    def head(self) -> dict[str, Any]:
        with self._changed:
            return dict(self._head)

    def read(self, cursor: Cursor | None, wait_s: float = 0.0) -> Update | None:
        """What is new since ``cursor`` (None: everything), waiting up to ``wait_s`` for something;
        None when nothing changed."""
        with self._changed:
            if cursor is not None and wait_s > 0 and self._cursor() == cursor:
                self._changed.wait(wait_s)
            now = self._cursor()
            if cursor == now:
                return None
            seen = cursor or Cursor()
            reset = cursor is None or seen.epoch != now.epoch
            first_line = self._lines_base if reset else max(seen.line, self._lines_base)
            return Update(
                reset=reset,
                head=dict(self._head),
                rows=list(self._rows) if reset or seen.rows != now.rows else None,
                points=self._points[0 if reset else seen.points:],
                lines=self._lines[first_line - self._lines_base:],
                events=self._events[0 if reset else seen.events:],
                evals=self._evals[0 if reset else seen.evals:],
                cursor=now,
            )

    def _cursor(self) -> Cursor:
        return Cursor(self._head_version, self._rows_version, self._points_epoch, len(self._points),
                      self._lines_base + len(self._lines), len(self._events), len(self._evals))

    def close(self) -> None:
        """Stop following (an attached job is detached from, never cancelled) and wake every page."""
        with self._changed:
            self._closing = True
            job = self._job
            self._changed.notify_all()
        if job is not None:
            job.cancel("dashboard closing", interrupted=True)  # attached + interrupted: only stops following

    # -- the follower thread

    def _run(self) -> None:
        """Follow the job, and after a failed attempt the ``--max-restarts`` attempt that comes next
        (``JOB-r1``, ...), as one run: its rows, points and lines go on, a ``restart`` event between."""
        attempt, number = self.job_id, 0
        while True:
            if not self._follow(attempt):
                return
            try:
                state, reason = self._final_state(attempt)
            except DistrunError as exc:
                state, reason = "unknown", exc.message
            following = f"{self.job_id}-r{number + 1}"
            if state != "failed":
                break
            self._set_state(state, reason)  # said at once; a restart may still come, and the page goes on
            if not self._comes(following):
                break
            number, attempt = number + 1, following
            self._add_entry({"time": time.time(), "rank": SERVER_RANK, "host": "", "kind": "restart",
                             "text": f"restart {number}: attempt {number} failed ({reason or 'no reason given'}); "
                                     f"{following} goes on from the newest checkpoint"}, attempts=number + 1)
        self._end(state, reason)

    def _comes(self, attempt: str) -> bool:
        """Whether ``attempt`` is listed within ``restart_wait_s`` (:data:`RESTART_WAIT_S`: the client
        submits it once it has seen the failure and stopped the failed attempt's ranks)."""
        if self._listed is None:
            return False
        deadline = time.monotonic() + self._restart_wait_s
        while not self._closing:
            try:
                if self._listed(attempt):
                    return True
            except DistrunError:
                pass
            if time.monotonic() > deadline:
                return False
            time.sleep(1.0)
        return False

    def _follow(self, job_id: str) -> bool:
        """Follow one attempt to its end; False where the dashboard closes (or it cannot be found: said)."""
        try:
            job = self._attach(job_id)
        except DistrunError as exc:
            self._end("unknown", exc.message)
            return False
        with self._changed:
            self._job = job
            closing = self._closing
        if closing:
            job.cancel("dashboard closing", interrupted=True)
        last_rows = 0.0
        last_event = 0.0  # the newest event's time: a finished job's wall time ends there, not now
        try:
            for event in job.events(poll_s=_ROWS_EVERY_S):
                last_event = max(last_event, getattr(event, "time", 0.0) or 0.0)
                if isinstance(event, Output):
                    self._add_line(event, job)
                elif isinstance(event, Step):
                    if event.compute_ms is not None:  # kept until the next figure, as the tracker keeps compute_ms
                        self._waits[event.rank] = wait_pct(event)
                    self._add_point(event, job.snapshot())
                elif event is not None:
                    self._add_event(event, job)
                if time.monotonic() - last_rows >= _ROWS_EVERY_S:
                    last_rows = time.monotonic()
                    self._set_rows(job.snapshot(), job)
            self._set_rows(job.snapshot(), job, ended_at=last_event or None)
        except DistrunError as exc:
            self._note(f"[dashboard] following the job failed: {exc.message}")
        finally:
            job.cancel("dashboard closing", interrupted=True)
            job.close()
        return not self._closing

    def _add_line(self, event: Output, job: Followed) -> None:
        line = {"rank": event.rank, "host": job.host_of_rank(event.rank), "stream": event.stream, "line": event.line,
                "time": event.time}
        with self._changed:
            self._lines.append(line)
            if len(self._lines) > MAX_LINES:
                drop = len(self._lines) - MAX_LINES
                del self._lines[:drop]
                self._lines_base += drop
            self._changed.notify_all()

    def _add_event(self, event: Event, job: Followed) -> None:
        entry = timeline_entry(event, job.host_of_rank(event.rank))
        if entry is not None:
            with self._changed:
                self._events.append(entry)
                if isinstance(event, Eval):
                    self._evals.append({"step": event.step, **event.metrics})
                self._changed.notify_all()

    def _add_entry(self, entry: dict[str, Any], attempts: int) -> None:
        """A line of the watch's own on the timeline (a restart), and the attempt count it brings."""
        with self._changed:
            self._events.append(entry)
            self._head["attempts"] = attempts
            self._head_version += 1
            self._changed.notify_all()

    def _add_point(self, event: Step, snapshot: JobSnapshot) -> None:
        """One point per step event of the lowest training rank (the chief's view of the loss)."""
        workers = [row.rank for row in snapshot.workers]
        if not workers or event.rank != min(workers):
            return
        point = {"step": event.step, "loss": event.loss, "samples_per_s": round(snapshot.samples_per_s, 2),
                 "lr": snapshot.lr}
        with self._changed:
            if self._points and self._points[-1]["step"] >= event.step:
                return  # a step seen already (the rows still show the newest figures)
            self._points.append(point)
            if len(self._points) > MAX_POINTS:
                self._points = self._points[::2] if len(self._points) % 2 else self._points[::2] + self._points[-1:]
                self._points_epoch += 1
            self._head_version += 1
            self._changed.notify_all()

    def _set_rows(self, snapshot: JobSnapshot, job: Followed, ended_at: float | None = None) -> None:
        rows = [{"rank": row.rank, "host": row.host or job.host_of_rank(row.rank), "device": row.device, "step": row.step,
                 "loss": row.loss, "samples_per_s": round(row.samples_per_s, 2), "mem_mb": round(row.mem_mb),
                 "peak_mem_mb": round(row.peak_mem_mb), "status": row.status.value, "role": row.role,
                 "compute_ms": row.compute_ms, "wait_pct": self._waits.get(row.rank),
                 "slow": row.slow if row.status is ReplicaStatus.RUNNING else None,  # as the live table flags it
                 "gpu_util": row.gpu_util} for row in snapshot.rows]
        head = {"recipe": snapshot.recipe, "strategy": snapshot.strategy, "step": snapshot.step,
                "total_steps": snapshot.total_steps, "loss": _chief_loss(snapshot),
                "samples_per_s": round(snapshot.samples_per_s, 2), "elapsed_s": round(_wall(snapshot, ended_at), 1),
                "hosts": sorted({row["host"] for row in rows if row["host"]}), "state": "running",
                "eval_metrics": dict(snapshot.eval_metrics), "straggler": snapshot.straggler_line}
        with self._changed:
            if rows != self._rows:
                self._rows = rows
                self._rows_version += 1
            if any(self._head.get(key) != value for key, value in head.items()):
                self._head.update(head)
                self._head_version += 1
            self._changed.notify_all()

    def _note(self, text: str) -> None:
        with self._changed:
            self._lines.append({"rank": SERVER_RANK, "host": "", "stream": "stderr", "line": text, "time": time.time()})
            self._changed.notify_all()

    def _set_state(self, state: str, reason: str | None, *, ended: bool = False) -> None:
        with self._changed:
            self._head.update(state=state, reason=reason, ended=ended)
            self._head_version += 1
            self._changed.notify_all()

    def _end(self, state: str, reason: str | None) -> None:
        self._set_state(state, reason, ended=True)


def wait_pct(event: Step) -> float | None:
    """The share of the rank's step spent waiting for its peers, in percent: the step's wall time less
    its compute time, both as the rank measured them over the same steps (``Step.step_ms`` and
    ``compute_ms``, the figures the straggler watch judges by). None where the strategy cannot tell
    its wait from its compute."""
    if event.step_ms is None or event.compute_ms is None or event.step_ms <= 0:
        return None
    return round(100.0 * max(event.step_ms - event.compute_ms, 0.0) / event.step_ms, 1)


def _chief_loss(snapshot: JobSnapshot) -> float | None:
    workers = snapshot.workers
    return min(workers, key=lambda row: row.rank).loss if workers else None


def _wall(snapshot: JobSnapshot, ended_at: float | None) -> float:
    """Seconds since the job started; for a finished job, until its last event."""
    if ended_at is None:
        return snapshot.elapsed_s
    return max(0.0, ended_at - (time.time() - snapshot.elapsed_s))
