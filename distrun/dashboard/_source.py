"""Where the dashboard's data comes from: the same client calls as `distrun jobs`, `attach`,
`stacks`, `cancel` and `status`, on the same servers and job records (no second source of truth).

A job's figures (step, loss, samples/s) are in its event log, not in the servers' job list,
so the jobs page is the list joined with a ``JobWatch`` of each of the newest jobs; a watch
follows a running job and replays a finished one once, and is kept while the dashboard runs.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from distrun.client import ClusterJob
from distrun.client.cluster import cluster_status
from distrun.client.diagnose import cluster_stacks
from distrun.client.jobs import JobRow, cancel_job, list_jobs
from distrun.config import ClusterSpec
from distrun.dashboard._watch import JobWatch
from distrun.errors import UsageError
from distrun.protocol import event_to_dict

__all__ = ["Source", "ATTEMPT", "JOB_ID", "LOCAL", "WATCHED", "fold_attempts", "listing"]

#: The label of this machine's own server and its jobs, beside the clusters' names.
LOCAL = "local"
#: What a job id looks like (`local-20250101-120000-42-1`, `20250101-120000-ab12cd`, `...-r1`).
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: How many of the newest jobs the jobs page shows figures for (each is followed or replayed once).
WATCHED = 20
#: How old a job list may be when a page asks again: every open jobs page shares one look at the
#: servers per interval (a cluster's costs a round trip to every host).
LIST_MAX_AGE_S = {True: 1.0, False: 3.0}


@dataclass(frozen=True)
class Source:
    """The cluster the dashboard shows (the embedded local one: this machine's jobs), and the
    watches of its jobs, by id."""

    cluster: ClusterSpec
    _watches: dict[str, JobWatch]
    _lock: threading.Lock
    _listed: list[tuple[float, list[JobRow], list[str]]]  # the newest look at the servers, when, and who was missed
    _listing: threading.Lock

    @classmethod
    def of(cls, cluster: ClusterSpec) -> Source:
        return cls(cluster, {}, threading.Lock(), [], threading.Lock())

    def _list(self) -> tuple[list[JobRow], list[str]]:
        """`list_jobs`, at most once per ``LIST_MAX_AGE_S`` whatever the number of pages asking."""
        with self._listing:
            if self._listed and time.monotonic() - self._listed[0][0] < LIST_MAX_AGE_S[self.cluster.local]:
                return self._listed[0][1], self._listed[0][2]
            unreachable: list[str] = []
            rows = list_jobs(self.cluster, unreachable)
            self._listed[:] = [(time.monotonic(), rows, unreachable)]
            return rows, unreachable

    @property
    def name(self) -> str:
        """The label the pages give the cluster's jobs and hosts: ``local`` for this machine's server."""
        return LOCAL if self.cluster.local else self.cluster.name

    def lists(self, job_id: str) -> bool:
        """Whether the cluster's servers list ``job_id`` (the shared look at them, not a new one)."""
        return any(row.job == job_id for row in self._list()[0])

    def _listed_now(self, job_id: str) -> bool:
        """Whether a server lists ``job_id`` now (a new look: a restart's attempt is seconds old)."""
        return any(row.job == job_id for row in list_jobs(self.cluster, []))

    def jobs(self) -> dict[str, Any]:
        """Every job, newest first, with its figures, a ``--max-restarts`` job's attempts one row (its
        newest attempt's state, and how many); ``unreachable``: hosts not listed, and why."""
        rows, unreachable = self._list()
        return listing(self.name, rows, unreachable, self.watch)

    def watch(self, job_id: str) -> JobWatch:
        """The job's watch, started on first use."""
        if not JOB_ID.fullmatch(job_id):
            raise UsageError(f"not a job id: {job_id[:64]!r}")
        with self._lock:
            watch = self._watches.get(job_id)
            if watch is None or watch.ended and watch.head()["state"] == "unknown":  # not found then: ask again
                listed = None if self.cluster.local else self._listed_now  # --max-restarts: a cluster's only
                watch = self._watches[job_id] = JobWatch(partial(ClusterJob.attach, self.cluster), job_id,
                                                         self._final_state, self.name, listed=listed).start()
            return watch

    def _final_state(self, job_id: str) -> tuple[str, str | None]:
        row = next((row for row in list_jobs(self.cluster, []) if row.job == job_id), None)
        if row is None:
            return "unknown", "no server lists the job any more"
        return row.state, row.reason or row.failure

    def cancel(self, job_id: str) -> list[str]:
        """`distrun cancel`: every host that runs the job is told, and records who stopped it."""
        self.watch(job_id)  # validates the id; the page follows the job to its end
        return cancel_job(self.cluster, job_id)

    def stacks(self, job_id: str) -> dict[str, Any]:
        """`distrun stacks JOB --json`: every rank's Python stack now, from every host."""
        self.watch(job_id)
        return {**event_to_dict(cluster_stacks(self.cluster, job_id)), "job": job_id}

    def hosts(self) -> dict[str, Any]:
        """`distrun status --json`: each host's server, its devices, memory and jobs."""
        return {**cluster_status(self.cluster).to_dict(), "cluster": self.name}

    def close(self) -> None:
        with self._lock:
            watches = list(self._watches.values())
        for watch in watches:
            watch.close()


#: A ``--max-restarts`` job's later attempts: ``JOB-r1``, ``JOB-r2``, ... (client/cluster_job.py).
ATTEMPT = re.compile(r"(?P<job>.+)-r(?P<number>[1-9][0-9]*)")


def fold_attempts(rows: list[JobRow]) -> list[tuple[JobRow, list[JobRow]]]:
    """Each logical job once, in ``rows``' order (newest first) at its first attempt's place, with its
    attempts oldest first: an ``ID-rN`` row whose ``ID`` is listed too is one of ``ID``'s attempts."""
    ids = {row.job for row in rows}
    attempts: dict[str, list[tuple[int, JobRow]]] = {row.job: [(0, row)] for row in rows}
    for row in rows:
        match = ATTEMPT.fullmatch(row.job)
        if match and match["job"] in ids:
            attempts[match["job"]].append((int(match["number"]), row))
            del attempts[row.job]
    return [(row, [attempt for _, attempt in sorted(attempts[row.job], key=lambda pair: pair[0])])
            for row in rows if row.job in attempts]


def listing(name: str, rows: list[JobRow], unreachable: list[str],
            watch: Callable[[str], JobWatch]) -> dict[str, Any]:
    """The jobs page's answer for one cluster (``name``): ``rows`` folded into logical jobs (newest
    first), the newest :data:`WATCHED` with the figures of their ``watch``."""
    listed = []
    for index, (row, attempts) in enumerate(fold_attempts(rows)):
        newest = attempts[-1]
        item = {**_row(row), "cluster": name, "attempts": len(attempts), "state": newest.state,
                "why": newest.reason or newest.failure,
                "hosts": sorted({host for attempt in attempts for host in attempt.hosts})}
        if index < WATCHED:
            head = watch(row.job).head()
            item.update({key: head[key] for key in ("step", "total_steps", "loss", "samples_per_s", "elapsed_s")})
        listed.append(item)
    return {"cluster": name, "jobs": listed, "unreachable": unreachable}


def _row(row: JobRow) -> dict[str, Any]:
    return {"job": row.job, "state": row.state, "recipe": row.recipe, "strategy": row.strategy, "layout": row.layout,
            "world_size": row.world_size, "world_now": row.world_now, "hosts": list(row.hosts),
            "started_at": row.started_at, "why": row.reason or row.failure}
