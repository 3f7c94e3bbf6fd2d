"""Jobs already on a cluster: list them, cancel one, read its per-rank output.

Each server keeps its jobs' event logs (``jobs/<id>/events.ndjson``), so these
work from any client, after a ``--detach`` or a client crash alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrun.client._job_state import blame, merge_states
from distrun.client._links import HostLink, holders_of, open_all
from distrun.client._stop import by_whom, stop_everywhere
from distrun.client._results import artifacts, fetch_newest_checkpoint, fetch_profile, fetch_tensorboard
from distrun.config import ClusterSpec
from distrun.errors import HostError, UsageError
from distrun.protocol import Output, decode_event

__all__ = ["JobRow", "job_rows", "list_jobs", "cancel_job", "job_output", "collapse_ranks", "pull_job"]


@dataclass(frozen=True)
class JobRow:
    job: str
    state: str
    recipe: str
    strategy: str
    world_size: int
    hosts: tuple[str, ...]
    started_at: float
    detached: bool
    world_now: int | None = None  # --elastic: replicas in the group now, where it changed
    reason: str | None = None  # stopped: why ("cancelled by alice from laptop")
    failure: str | None = None  # failed: the root cause, its host, rank and recipe line
    layout: str = ""  # JobSpec.layout: "dp 2 x tp 2 · accumulate 2" ("" from an older server)

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "hosts": list(self.hosts)}


def _links(cluster: ClusterSpec) -> list[HostLink]:
    links = [HostLink(cluster, host) for host in cluster.hosts]
    open_all(links)
    return links


def list_jobs(cluster: ClusterSpec, unreachable: list[str] | None = None) -> list[JobRow]:
    """Every job every server knows, one row per job (its hosts merged), newest first.

    A host that cannot be reached (its server is down: a lost host of an elastic job)
    is skipped and, when ``unreachable`` is given, named there with why; when no host
    can be reached, the first host's error is raised.
    """
    links = [HostLink(cluster, host) for host in cluster.hosts]
    answers: list[tuple[str, list[dict[str, Any]]]] = []
    errors: list[HostError] = []
    try:
        for link in links:
            try:
                link.open()
                answers.append((link.label, link.call("jobs")["jobs"]))
            except HostError as exc:
                if unreachable is None:
                    raise
                errors.append(exc)
    finally:
        for link in links:
            link.close()
    if errors and len(errors) == len(links):
        raise errors[0]
    if unreachable is not None:
        unreachable.extend(f"{error.host}: {error.reason}" for error in errors)
    return job_rows(answers)


def job_rows(answers: list[tuple[str, list[dict[str, Any]]]]) -> list[JobRow]:
    """One row per job, newest first, from each host's ``jobs`` answer (its label, its summaries): a
    job's hosts merged, its state the merge of theirs. The servers' listing and the history `down`
    kept on the client (``client/history``) both read this way."""
    merged: dict[str, tuple[dict[str, Any], list[str], list[dict[str, Any]]]] = {}
    for label, jobs in answers:
        for job in jobs:
            meta, hosts, parts = merged.setdefault(job["job"], (job, [], []))
            hosts.append(label)
            parts.append(job)
            if job.get("world_now") and job["world_now"][1] > (meta.get("world_now") or [0, 0])[1]:
                meta["world_now"] = job["world_now"]  # the newest change, from whichever host saw it
    rows = []
    for job_id, (meta, hosts, parts) in merged.items():
        state = merge_states(str(part["state"]) for part in parts)
        reason = next((str(part["reason"]) for part in parts if part.get("reason")), None)
        rows.append(JobRow(job_id, state, meta.get("recipe", "?"), meta.get("strategy", "?"),
                           int(meta.get("world_size", 0)), tuple(hosts), float(meta["started_at"]),
                           bool(meta.get("detached")),
                           int(meta["world_now"][0]) if meta.get("world_now") else None,
                           reason=reason if state in ("stopped", "running", "pending") else None,
                           failure=blame(zip(hosts, parts)) if state in ("failed", "lost") else None,
                           layout=str(meta.get("layout") or "")))
    return sorted(rows, key=lambda row: row.started_at, reverse=True)


@contextmanager
def job_hosts(cluster: ClusterSpec, job_id: str) -> Iterator[list[HostLink]]:
    """Every host's link, open; yields those that run ``job_id`` (UsageError if none does)."""
    links = _links(cluster)
    try:
        holders = [link for link, _record in holders_of(links, job_id)]
        if not holders:
            raise UsageError(f"no job {job_id!r} on any host; `distrun jobs` lists them")
        yield holders
    finally:
        for link in links:
            link.close()


def cancel_job(cluster: ClusterSpec, job_id: str) -> list[str]:
    """Cancel ``job_id`` on every host that has it, as one decision (``client/_stop``); return those
    hosts. A host that could not be told is named in a HostError, after the others were stopped."""
    with job_hosts(cluster, job_id) as holders:
        errors = stop_everywhere(holders, job_id, by_whom("cancelled"))
        if errors:
            stopped = [link.label for link in holders if all(error.host != link.label for error in errors)]
            also = f" (stopped on {', '.join(stopped)})" if stopped else ""
            raise HostError(errors[0].host, f"{errors[0].reason}{also}")
        return [link.label for link in holders]


def pull_job(cluster: ClusterSpec, job_id: str, dest: Path) -> tuple[Path | None, list[Path]]:
    """Fetch the newest checkpoint of ``job_id`` from whichever host wrote it, any ``--tensorboard``
    files into ``dest``/tensorboard and every host's ``--profile`` traces into ``dest``/profile:
    (the checkpoint or None, the traces)."""
    with job_hosts(cluster, job_id) as holders:
        found = {link.label: artifacts(link, job_id) for link in holders}  # one call per host for all three
        traces: list[Path] = []
        for link in holders:
            fetch_tensorboard(link, job_id, dest / "tensorboard", found[link.label])
            traces += fetch_profile(link, job_id, dest / "profile", found[link.label])
        for link in holders:
            fetched = fetch_newest_checkpoint(link, job_id, dest, found[link.label])
            if fetched is not None:
                return fetched, traces
        return None, traces


def job_output(cluster: ClusterSpec, job_id: str, *, follow: bool) -> Iterator[tuple[str, Output]]:
    """(host, output line) of every rank, host by host; with ``follow``, until the job ends."""
    with job_hosts(cluster, job_id) as holders:
        for link in holders:
            with link.client() as client:
                for item in client.stream("follow", job=job_id, offset=0, until_now=not follow, silence_s=30.0):
                    for raw in item.get("events", ()):
                        if raw.get("type") == "output":
                            event = decode_event(json.dumps(raw))
                            assert isinstance(event, Output)
                            yield link.label, event


def collapse_ranks(lines: list[tuple[int, str]]) -> list[tuple[tuple[int, ...], str]]:
    """Merge the same text printed by many ranks ("ranks 0-3: ...") while keeping each rank's order.

    The n-th occurrence of a text in one rank's output is matched with the n-th
    occurrence in the others', so a line every rank prints each epoch collapses
    once per epoch, not once in all.
    """
    seen: dict[tuple[int, str], int] = {}
    groups: dict[tuple[str, int], list[int]] = {}
    order: list[tuple[str, int]] = []
    for rank, text in lines:
        nth = seen.get((rank, text), 0)
        seen[(rank, text)] = nth + 1
        key = (text, nth)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(rank)
    return [(tuple(sorted(groups[key])), key[0]) for key in order]
