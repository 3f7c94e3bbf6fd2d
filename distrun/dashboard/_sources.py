"""Several clusters on one page: this machine's server and every cluster `up` brought up from here.

Each cluster keeps its own ``Source`` (its own shared look at its servers, its own watches);
this asks them side by side, in threads, so that a cluster whose hosts are slow or gone
delays no other's rows and costs the page one line saying why. A cluster taken `down` is shown
from the history `down` kept (``_kept``), labelled ``NAME (down)``. A job's page finds its
cluster by asking which one lists the job (ids are unique per cluster, and a local job's
starts ``local-``). A cluster file that could not be loaded when the dashboard started is
shown as such, not dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from distrun.dashboard._kept import KeptSource
from distrun.dashboard._source import LOCAL, Source
from distrun.dashboard._watch import JobWatch
from distrun.errors import DistrunError, UsageError

__all__ = ["Sources", "Unloaded"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class Unloaded:
    """A recorded cluster that could not be shown: its name, its file, and why (one line)."""

    name: str
    file: str
    reason: str

    @property
    def why(self) -> str:
        """The reason, naming the file once (a loader's message often names it already)."""
        return self.reason if self.file in self.reason else f"{self.file}: {self.reason}"


@dataclass(frozen=True)
class Sources:
    """The clusters the dashboard shows, in the order given (this machine's first); ``unloaded``:
    those recorded but not loadable."""

    sources: tuple[Source | KeptSource, ...]  # a cluster that is down: its history (``_kept``)
    unloaded: tuple[Unloaded, ...] = ()

    @property
    def name(self) -> str:
        """What the page's header shows: every cluster's label."""
        return " · ".join([source.name for source in self.sources] + [f"{item.name} (not loaded)" for item in self.unloaded])

    def jobs(self) -> dict[str, Any]:
        """Every cluster's jobs, newest first, each labelled with its ``cluster``; ``clusters``: each
        cluster's label and, where its servers could not be listed, why."""
        jobs: list[dict[str, Any]] = []
        unreachable: list[str] = []
        clusters: list[dict[str, Any]] = []
        for source, answer in zip(self.sources, self._each(lambda source: source.jobs())):
            if isinstance(answer, DistrunError):
                clusters.append({"name": source.name, "error": answer.message})
                continue
            clusters.append({"name": source.name, "error": None, "jobs": len(answer["jobs"])})
            jobs.extend(answer["jobs"])
            unreachable.extend(f"{source.name}: {why}" for why in answer["unreachable"])
        clusters.extend({"name": item.name, "error": item.why} for item in self.unloaded)
        jobs.sort(key=lambda job: job["started_at"], reverse=True)
        return {"cluster": self.name, "jobs": jobs, "unreachable": unreachable, "clusters": clusters}

    def hosts(self) -> dict[str, Any]:
        """Every cluster's hosts as `distrun status --json` gives them, each row labelled with its ``cluster``."""
        hosts: list[dict[str, Any]] = []
        for source, answer in zip(self.sources, self._each(lambda source: source.hosts())):
            if isinstance(answer, DistrunError):
                hosts.append({"cluster": source.name, "host": "—", "roles": [], "status": "error",
                              "message": answer.message, "server": None, "rtt_ms": None})
                continue
            hosts.extend({**row, "cluster": source.name} for row in answer["hosts"])
        hosts.extend({"cluster": item.name, "host": "—", "roles": [], "status": "error",
                      "message": item.why, "server": None, "rtt_ms": None}
                     for item in self.unloaded)
        return {"cluster": self.name, "hosts": hosts}

    def watch(self, job_id: str) -> JobWatch:
        return self.source_of(job_id).watch(job_id)

    def cancel(self, job_id: str) -> list[str]:
        return self.source_of(job_id).cancel(job_id)

    def stacks(self, job_id: str) -> dict[str, Any]:
        return self.source_of(job_id).stacks(job_id)

    def source_of(self, job_id: str) -> Source | KeptSource:
        """The cluster whose servers list ``job_id``; with one cluster, that one (it says if it does not)."""
        if len(self.sources) == 1:
            return self.sources[0]
        local = next((source for source in self.sources if source.name == LOCAL), None)
        if local is not None and job_id.startswith("local-"):
            return local
        found = [source for source, lists in zip(self.sources, self._each(lambda source: source.lists(job_id)))
                 if lists is True]
        if not found:
            raise UsageError(f"no cluster lists job {job_id[:64]!r} ({self.name})")
        return found[0]

    def close(self) -> None:
        for source in self.sources:
            source.close()

    def _each(self, ask: Callable[[Source | KeptSource], _T]) -> list[_T | DistrunError]:
        """``ask`` of every cluster at once; a cluster's DistrunError is its answer, not the page's."""
        def guarded(source: Source | KeptSource) -> _T | DistrunError:
            try:
                return ask(source)
            except DistrunError as exc:
                return exc

        if len(self.sources) == 1:
            return [guarded(self.sources[0])]
        with ThreadPoolExecutor(max_workers=len(self.sources), thread_name_prefix="dashboard-cluster") as pool:
            return list(pool.map(guarded, self.sources))
