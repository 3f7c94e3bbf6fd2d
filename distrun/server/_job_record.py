"""One job as a worker server keeps it: its event log, state, result and why it stopped.

The log is both in memory (``lines``: followers read from any offset) and on disk
(``events.ndjson``, unbuffered, so a line lands at once and survives the server);
``finish`` writes ``result.json`` beside it, and ``job.json`` (when it started, its recipe and
strategy), which is how a job the server no longer keeps in memory is read back, and listed
after the server restarts (``past_jobs``: the jobs page's history outlives the server).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, BinaryIO

from distrun.launch import LocalLauncher
from distrun.protocol import SERVER_RANK, Event, MembershipChanged, Output, encode_event, event_to_dict
from distrun.server._job_args import _JOB_ID as JOB_ID, files_under, traces_in
from distrun.server._local_job import LocalJobChannel

__all__ = ["JOB_ID", "JobRecord", "PACK_MAX_BYTES", "PACK_MAX_EVENTS_BYTES", "RECORD_FILES", "finished_jobs",
           "job_files", "pack_jobs", "past_jobs"]

#: Finished jobs listed from disk beside those a server keeps in memory: the newest, by when they ended.
LISTED_FROM_DISK = 200


@dataclasses.dataclass
class JobRecord:
    id: str
    folder: Path
    lines: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    changed: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    state: str = "pending"
    result: dict[str, Any] | None = None
    #: Runs the job's ranks here; for a local `distrun train`'s job, its connection stands in.
    launcher: LocalLauncher | LocalJobChannel | None = None
    listener: socket.socket | None = None
    started_at: float = dataclasses.field(default_factory=time.time)
    detached: bool = False
    followers: int = 0
    unfollowed_since: float = dataclasses.field(default_factory=time.monotonic)  # when the last follower left
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    log: BinaryIO | None = None  # events.ndjson, open while the job runs (unbuffered: each line lands at once)
    secret: str = dataclasses.field(default="", repr=False)  # the data plane's key, from rendezvous
    finished_at: float | None = None  # time.monotonic() at finish: forgotten KEEP_FINISHED_S later
    rendezvous_lease: threading.Timer | None = None  # closes the rendezvous if no submit comes
    reason: str | None = None  # why it was stopped ("cancelled by alice from laptop"), once decided
    local: bool = False  # a local `distrun train`'s job, listed here: its connection is its lease

    def record(self, event: Event) -> None:
        with self.changed:
            if isinstance(event, MembershipChanged):  # --elastic: `distrun jobs` shows the group's size now
                self.meta["world_now"] = [event.world_size, event.time]
            self.lines.append(event_to_dict(event))
            if self.log is None:
                self.log = open(self.folder / "events.ndjson", "ab", buffering=0)  # noqa: SIM115 - closed in finish()
            self.log.write(encode_event(event))
            self.changed.notify_all()

    def record_note(self, text: str) -> None:
        """A line from the server itself in the job's log (shown by `distrun logs`, `attach`)."""
        self.record(Output(rank=SERVER_RANK, time=time.time(), stream="stderr", line=f"[distrun server] {text}"))

    def finish(self, state: str, result: dict[str, Any]) -> None:
        with self.changed:
            self.state, self.result = state, result
            self.finished_at = time.monotonic()
            try:  # only the listing's: a job without it is still read back by `follow`
                (self.folder / "job.json").write_text(json.dumps({"started_at": self.started_at, "meta": self.meta}))
            except OSError:
                pass
            (self.folder / "result.json").write_text(json.dumps(result))
            if self.log is not None:
                self.log.close()
                self.log = None
            self.changed.notify_all()

    def set_aside(self) -> None:
        """An ended record's files renamed ``result.N.json``/``events.N.ndjson``, so a new record of
        the same job starts here (``--elastic``: this host's ranks rejoin after they ended)."""
        number = 1
        while (self.folder / f"result.{number}.json").exists():
            number += 1
        for name, kept in (("result.json", f"result.{number}.json"), ("events.ndjson", f"events.{number}.ndjson")):
            if (self.folder / name).exists():
                (self.folder / name).rename(self.folder / kept)

    def decide_stop(self, reason: str) -> bool:
        """Remember why the job stops (the first reason wins); True the first time."""
        with self.changed:
            if self.reason is not None or self.result is not None:  # decided already, or finished
                return False
            self.reason = reason
        self.record_note(f"stopping: {reason}")
        return True

    @classmethod
    def read_back(cls, job_id: str, folder: Path) -> JobRecord | None:
        """A finished job its server no longer keeps: its log and result, read back from ``folder``."""
        try:
            result = json.loads((folder / "result.json").read_text())
            raw = (folder / "events.ndjson").read_bytes() if (folder / "events.ndjson").is_file() else b""
        except (OSError, ValueError):
            return None
        lines = []
        for line in raw.splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        job = cls(job_id, folder, lines=lines, state=str(result.get("state", "finished")), result=result,
                  reason=result.get("reason"), **_started(folder))
        job.finished_at = time.monotonic()
        return job

    def artifacts(self) -> dict[str, Any]:
        """What the job left for the client to fetch: the newest checkpoint its ranks wrote here (from
        its event log; a sharded one's files named), its ``--tensorboard`` files, its ``--profile`` traces."""
        with self.changed:
            saved = [line for line in self.lines if line.get("type") == "checkpoint"]
        newest = max(saved, key=lambda line: line["step"]) if saved else None
        board = self.folder / "tensorboard"
        profile = self.folder / "profile"
        checkpoint = Path(newest["path"]) if newest else None
        parts = sorted(entry.name for entry in checkpoint.iterdir() if entry.is_file()) \
            if checkpoint is not None and checkpoint.is_dir() else None
        return {"checkpoint": str(checkpoint) if checkpoint else None, "checkpoint_files": parts,
                "step": newest["step"] if newest else None,
                "result": self.result, "tensorboard": {"dir": str(board), "files": files_under(board)},
                "profile": {"dir": str(profile), "files": traces_in(profile)}}

    def summary(self) -> dict[str, Any]:
        """What ``distrun jobs`` lists: the state, why it stopped, and (failed) the root cause."""
        result = self.result or {}
        reason = self.reason if self.state not in ("succeeded", "failed") else None
        return {"job": self.id, "state": self.state, "started_at": self.started_at, "events": len(self.lines),
                "detached": self.detached, "followers": self.followers, "reason": reason,
                "failure": result.get("failure"), "error": result.get("error"), **self.meta}


def _started(folder: Path) -> dict[str, Any]:
    """``job.json``'s start time and meta (none from a job that ended before it was written)."""
    try:
        data = json.loads((folder / "job.json").read_text())
        return {"started_at": float(data["started_at"]), "meta": dict(data["meta"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def finished_jobs(jobs_dir: Path, kept: Collection[str] = (), limit: int = LISTED_FROM_DISK) -> list[str]:
    """The ids of the finished jobs in ``jobs_dir`` but ``kept``, the newest ``limit`` by when they
    ended, newest first: the folders holding both ``job.json`` and ``result.json`` (written at the end,
    ``job.json`` first: a job running elsewhere, or never submitted, has neither). A folder without
    ``job.json`` (a job of an older server, or one whose write failed) is left out: without its start
    it would sort as the newest job, named ``?``."""
    ended = []
    try:
        entries = list(os.scandir(jobs_dir))
    except OSError:
        return []
    for entry in entries:
        if entry.name in kept or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            os.stat(os.path.join(entry.path, "job.json"))
            ended.append((os.stat(os.path.join(entry.path, "result.json")).st_mtime, entry.name))
        except OSError:
            continue
    return [name for _mtime, name in sorted(ended, reverse=True)[:limit]]


def past_jobs(jobs_dir: Path, kept: set[str], limit: int = LISTED_FROM_DISK) -> list[dict[str, Any]]:
    """The summaries of :func:`finished_jobs` (the server does not keep them: ``kept``), from their
    ``result.json`` and ``job.json`` alone: a listing reads no log (``events`` is None; ``follow``
    reads one when it is asked for)."""
    listed = []
    for name in finished_jobs(jobs_dir, kept, limit):
        folder = jobs_dir / name
        started = _started(folder)
        try:
            result = json.loads((folder / "result.json").read_text())
        except (OSError, ValueError):
            continue
        if not started:  # job.json unreadable: as if it were not there
            continue
        record = JobRecord(name, folder, state=str(result.get("state", "finished")), result=result,
                           reason=result.get("reason"), **started)
        listed.append({**record.summary(), "events": None})
    return listed


#: A finished job's files, as `python -m distrun.server history` names them for the client to keep.
RECORD_FILES = ("job.json", "events.ndjson", "result.json")
#: What `history --pack` sends at most: a log larger than the first stays on its host (a long run's
#: step events; its job's other files go), and past the second in all, no more logs.
PACK_MAX_EVENTS_BYTES = 64 * 2**20
PACK_MAX_BYTES = 512 * 2**20


def job_files(jobs_dir: Path, limit: int = LISTED_FROM_DISK) -> list[dict[str, Any]]:
    """Each of the newest ``limit`` finished jobs' files and their sizes in bytes (``RECORD_FILES``
    that exist), and when it ended (``result.json``'s mtime), newest first: what `distrun down`
    copies into the client's history."""
    listed = []
    for name in finished_jobs(jobs_dir, limit=limit):
        stats = {}
        for file in RECORD_FILES:
            try:
                stats[file] = os.stat(jobs_dir / name / file)
            except OSError:
                continue
        if "result.json" in stats:
            listed.append({"job": name, "files": {file: stat.st_size for file, stat in stats.items()},
                           "ended_at": stats["result.json"].st_mtime})
    return listed


def pack_jobs(jobs_dir: Path, job_ids: list[str], out: BinaryIO, *, max_events_bytes: int, max_bytes: int) -> None:
    """Write ``job_ids``' record files to ``out`` as one uncompressed tar (``JOB/FILE``, each with its
    mtime), in the order given: what `distrun down` keeps of a host in one transfer instead of a
    round trip per file. A log over ``max_events_bytes``, or past ``max_bytes`` in all, is left out
    (its job's other files go); an id that names no finished job is skipped."""
    import tarfile

    left = max_bytes
    with tarfile.open(fileobj=out, mode="w|") as tar:
        for job_id in job_ids:
            folder = jobs_dir / job_id
            if not JOB_ID.fullmatch(job_id) or not (folder / "result.json").is_file():
                continue
            for name in RECORD_FILES:
                path = folder / name
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                if name == "events.ndjson" and size > min(max_events_bytes, left):
                    continue
                left -= size
                tar.add(path, arcname=f"{job_id}/{name}", recursive=False)
