"""A cluster that is down, shown from the history `down` kept on this machine (``client/history``).

Its jobs are listed, and their pages rebuilt, as a live cluster's are: the same listing, the same
watch, fed from the kept copies of the servers' records instead of the servers. Each job is
replayed once (the hosts' logs merged by time, each host's in its own order) through the same
tracker the live view folds events with, so its rank table, charts, events and logs read as they
did. Nothing runs there, so Cancel and Stacks answer that the cluster is down.
"""

from __future__ import annotations

import heapq
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

from distrun.client import JobTracker
from distrun.client._feed import EventFeed
from distrun.client.history import KeptCluster
from distrun.client.jobs import JobRow
from distrun.dashboard._source import ATTEMPT, JOB_ID, listing
from distrun.dashboard._watch import JobWatch
from distrun.errors import UsageError
from distrun.protocol import EVALUATOR_RANK, Event, JobSnapshot, decode_event
from distrun.server._job_record import JobRecord

__all__ = ["KeptJob", "KeptSource"]


class KeptJob:
    """One kept job, replayed: ``records`` are its hosts' (label, record), in rank order."""

    def __init__(self, records: list[tuple[str, JobRecord]]) -> None:
        self._ranges = [(label, *record.meta["ranks"]) for label, record in records]
        meta, started_at = records[0][1].meta, records[0][1].started_at
        ps_tasks = int(meta.get("ps_tasks", 0))
        self._feed = EventFeed(JobTracker(meta.get("recipe", "?"), meta.get("strategy", "?"),
                                          int(meta.get("world_size", 0)) - ps_tasks, ps_tasks=ps_tasks,
                                          started_at=started_at, host_of_rank=self.host_of_rank))
        logs = [[line for line in record.lines if isinstance(line, dict)] for _label, record in records]
        for raw in heapq.merge(*logs, key=lambda line: float(line.get("time") or 0.0)):
            try:
                self._feed.put(decode_event(json.dumps(raw)))
            except (ValueError, KeyError, TypeError):
                continue  # a line of a newer distrun's: the rest still reads
        self._feed.end()

    def events(self, poll_s: float = 0.25) -> Iterator[Event | None]:
        return self._feed.events(poll_s)

    def snapshot(self) -> JobSnapshot:
        return self._feed.snapshot()

    def host_of_rank(self, rank: int) -> str:
        if rank == EVALUATOR_RANK:
            return "evaluator"
        if rank < 0:
            return "server"
        return next((label for label, first, last in self._ranges if first <= rank <= last), "?")

    def cancel(self, reason: str = "cancelled", *, interrupted: bool = False) -> None:
        """Nothing to stop or detach from: the job ended with its cluster."""

    def close(self) -> None:
        """Nothing is held open."""


class KeptSource:
    """The dashboard's view of a cluster that is down: its kept jobs, listed and replayed."""

    def __init__(self, kept: KeptCluster) -> None:
        self.kept = kept
        self._watches: dict[str, JobWatch] = {}
        self._lock = threading.Lock()
        self._rows: list[JobRow] = []
        self._read_at = 0.0

    @property
    def name(self) -> str:
        """The cluster's name, marked as down: what the pages label its jobs and hosts."""
        return f"{self.kept.name} (down)"

    def _list(self) -> list[JobRow]:
        """The kept rows, read again at most every few seconds (a later `down` may add jobs)."""
        with self._lock:
            if time.monotonic() - self._read_at > 5.0:
                self._rows, self._read_at = self.kept.rows(), time.monotonic()
            return self._rows

    def lists(self, job_id: str) -> bool:
        return any(row.job == job_id for row in self._list())

    def jobs(self) -> dict[str, Any]:
        return listing(self.name, self._list(), [], self.watch)

    def watch(self, job_id: str) -> JobWatch:
        if not JOB_ID.fullmatch(job_id):
            raise UsageError(f"not a job id: {job_id[:64]!r}")
        with self._lock:
            watch = self._watches.get(job_id)
            if watch is None:
                # A kept --max-restarts attempt is there or never will be: no wait for one to come.
                watch = self._watches[job_id] = JobWatch(self._attach, job_id, self._final_state, self.name,
                                                         listed=self.lists, restart_wait_s=0.0).start()
            return watch

    def _attach(self, job_id: str) -> KeptJob:
        records = self.kept.records(job_id)
        if not records:
            raise UsageError(f"no job {job_id!r} in the history kept of {self.kept.name} ({self.kept.folder})")
        try:
            return KeptJob(records)
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"job {job_id!r} in the history kept of {self.kept.name} does not read: "
                             f"{type(exc).__name__}: {exc}") from None

    def _final_state(self, job_id: str) -> tuple[str, str | None]:
        row = next((row for row in self._list() if row.job == job_id), None)
        if row is None:
            return "unknown", f"not in the history kept of {self.kept.name}"
        return row.state, row.reason or row.failure

    def _down(self, job_id: str) -> UsageError:
        base = ATTEMPT.fullmatch(job_id)
        return UsageError(f"{self.kept.name} is down: job {base['job'] if base else job_id} ended with it "
                          f"(`distrun up {self.kept.file}` brings the cluster back)")

    def cancel(self, job_id: str) -> list[str]:
        raise self._down(job_id)

    def stacks(self, job_id: str) -> dict[str, Any]:
        raise self._down(job_id)

    def hosts(self) -> dict[str, Any]:
        """Each kept host, down, with when its history was kept."""
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.kept.kept_at))
        return {"cluster": self.name, "hosts": [
            {"host": label, "roles": [], "status": "down", "server": None, "rtt_ms": None,
             "message": f"down since {when}; its past jobs are kept on this machine ({self.kept.folder})"}
            for label in self.kept.hosts]}

    def close(self) -> None:
        with self._lock:
            watches = list(self._watches.values())
        for watch in watches:
            watch.close()
