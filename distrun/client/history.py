"""The history `distrun down` keeps on the client: a cluster's finished jobs, after its servers.

A worker server lists its finished jobs from their folders (``jobs/JOB``: ``job.json``,
``events.ndjson``, ``result.json``), so they outlive the server while it can be restarted; but
once a cluster is taken `down` nothing answers for them, and once its hosts are gone (cloud
machines given back, a Slurm allocation ended) the records are gone too. Ray's dashboard loses
its jobs with its head node (its history-server proposal is about this); SkyPilot keeps a
cluster's job table on the client after `sky down`.

So `down CLUSTER` copies each host's newest finished jobs' records into
``$DISTRUN_HOME/history/NAME-HASH/HOST/JOB/`` (NAME the cluster's, HASH from the cluster file's
path, HOST the host's label, quoted), after its server has stopped (the jobs `down` itself
stopped are in it), over the link `down` already has (SSH, or srun on a Slurm allocation). A job
kept once is copied again only if its result changed since (an ``--elastic`` host's ranks that
rejoined); a host's newest :data:`KEPT_JOBS` are kept. A log over :data:`MAX_EVENTS_BYTES`, or
past :data:`MAX_HOST_BYTES` copied from the host at one `down`, is left there (the job is listed,
from its result, without charts or logs). Only a job's newest record on a host is kept (an
``--elastic`` host's earlier ones, ``events.N.ndjson``, stay there). Each file lands under a temporary
name and ``result.json`` last, so a `down` cut short never leaves a half record that reads as
whole. `distrun dashboard` shows a kept cluster's jobs, and their pages, while it is not up.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from distrun.client.jobs import JobRow, job_rows
from distrun.errors import HostError
from distrun.links import Remote, last_line
from distrun.server._job_record import (JOB_ID, LISTED_FROM_DISK, PACK_MAX_BYTES, PACK_MAX_EVENTS_BYTES, RECORD_FILES,
                                        JobRecord, finished_jobs, past_jobs)

__all__ = ["HISTORY", "KEPT_JOBS", "KeptCluster", "MAX_EVENTS_BYTES", "MAX_HOST_BYTES", "history_dir", "keep_host_history", "kept_clusters",
           "note_kept"]

#: The folder in ``$DISTRUN_HOME`` holding every kept cluster's history.
HISTORY = "history"
#: In a kept cluster's folder: its name, its file and when `down` last kept it.
_RECORD = "cluster.json"
#: A job log larger than this stays on its host (a long run's step events; its listing is kept).
MAX_EVENTS_BYTES = PACK_MAX_EVENTS_BYTES
#: The jobs kept per host: as many as a server lists from its folders.
KEPT_JOBS = LISTED_FROM_DISK


def history_dir(home: str, cluster_file: Path, name: str) -> Path:
    """Where ``cluster_file``'s history is kept: one folder per file (two files may name their
    clusters alike), named so that a person can find it."""
    path = str(cluster_file.expanduser().resolve())
    digest = hashlib.sha256(path.encode()).hexdigest()[:8]
    return Path(home).expanduser() / HISTORY / f"{quote(name, safe='')}-{digest}"


#: At most this many bytes copied from one host per `down` (the newest jobs first); the rest keep
#: their listing, and a later `down` copies on.
MAX_HOST_BYTES = PACK_MAX_BYTES


@dataclass(frozen=True)
class _Listed:
    """One finished job as a host's ``history`` command lists it."""

    job: str
    ended_at: float  # result.json's mtime on the host: the copy is dated alike, and copied again if it changes


def _listed(stdout: str) -> list[_Listed]:
    """The host's answer, checked whole: ValueError on anything but a list of well-formed jobs."""
    try:
        jobs = json.loads(stdout)["jobs"]
    except (KeyError, TypeError, RecursionError) as exc:
        raise ValueError(f"not a list of jobs ({type(exc).__name__})") from None
    if not isinstance(jobs, list):
        raise ValueError("not a list of jobs")
    listed = []
    for job in jobs:
        if not (isinstance(job, dict) and isinstance(job.get("job"), str) and JOB_ID.fullmatch(job["job"])
                and isinstance(job.get("files"), dict) and isinstance(job.get("ended_at"), (int, float))
                and all(name in RECORD_FILES and isinstance(size, int) and size >= 0
                        for name, size in job["files"].items())):
            raise ValueError(f"a job entry that does not read: {str(job)[:80]}")
        listed.append(_Listed(job["job"], float(job["ended_at"])))
    return listed


def keep_host_history(remote: Remote, python: str, state_dir: str, label: str, folder: Path) -> int:
    """Copy ``label``'s finished jobs' records (its server's ``state_dir``, read by ``python``) into
    ``folder``/HOST, newest first, up to :data:`MAX_HOST_BYTES`, in one transfer (a tar the host
    writes: one round trip, not one per file, which over a distant link or srun costs seconds
    each), then drop all but the newest :data:`KEPT_JOBS` kept there; how many jobs were copied.
    HostError where the host cannot list or pack them (an older distrun there: no ``history``
    command); the jobs copied before a failure stay, whole."""
    argv = [python, "-m", "distrun.server", "history", "--state-dir", state_dir]
    result = remote.run(argv)
    try:
        if not result.ok:
            raise ValueError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.code}")
        listed = _listed(result.stdout)
    except ValueError as exc:
        raise HostError(label, f"cannot list its past jobs to keep their history: {exc}") from None
    host_folder = _host_folder(folder, label)
    wanted = {job.job: job for job in listed if not _kept(host_folder / job.job, job)}
    kept = 0
    if wanted:
        packed = remote.run_raw([*argv, "--pack", *wanted, "--max-events-bytes", str(MAX_EVENTS_BYTES),
                                 "--max-bytes", str(MAX_HOST_BYTES)], timeout_s=600.0)
        kept = _unpack(packed.stdout, wanted, host_folder)
        if packed.exited != 0:
            why = last_line(packed.stderr.decode(errors="replace")) or f"exit {packed.exited}"
            raise HostError(label, f"kept {kept} past job(s), then: {why}")
    _prune(host_folder)
    return kept


def _kept(dest: Path, job: _Listed) -> bool:
    """Whether ``job`` is kept at ``dest`` already, and has not changed on its host since (an
    ``--elastic`` host's ranks may rejoin and end again)."""
    try:
        return abs((dest / "result.json").stat().st_mtime - job.ended_at) < 1e-3
    except OSError:
        return False


def _unpack(data: bytes, wanted: dict[str, _Listed], host_folder: Path) -> int:
    """Write the host's tar of ``wanted``'s files under ``host_folder`` (a member that is not a
    wanted job's record file, or not a plain file, is skipped: nothing the host sends lands
    anywhere else); how many jobs arrived whole."""
    whole: set[str] = set()
    got: dict[str, set[str]] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                job_id, _, name = member.name.partition("/")
                if not member.isfile() or job_id not in wanted or name not in RECORD_FILES:
                    continue
                source = tar.extractfile(member)
                if source is None:
                    continue
                dest = host_folder / job_id
                dest.mkdir(parents=True, exist_ok=True)
                part = dest / f".{name}.part"
                part.write_bytes(source.read())
                os.replace(part, dest / name)
                got.setdefault(job_id, set()).add(name)
                if name == "result.json":  # the host sends it last: the record is whole
                    if "events.ndjson" not in got[job_id]:
                        (dest / "events.ndjson").unlink(missing_ok=True)  # an older copy's, or none: not this record's
                    ended = wanted[job_id].ended_at
                    os.utime(dest / name, (ended, ended))
                    whole.add(job_id)
    except tarfile.TarError:
        pass  # cut short: the jobs whole before the cut stay; the caller says why the host stopped
    return len(whole)


def _prune(host_folder: Path) -> None:
    """All but the newest :data:`KEPT_JOBS` of a host's kept jobs go (by when they ended)."""
    for old in finished_jobs(host_folder, limit=2**31)[KEPT_JOBS:]:
        shutil.rmtree(host_folder / old, ignore_errors=True)


def _host_folder(folder: Path, label: str) -> Path:
    """A host's folder in a kept cluster's: its label, quoted (``KeptCluster.hosts`` unquotes it)."""
    return folder / quote(label, safe=":")


def note_kept(folder: Path, name: str, cluster_file: Path) -> None:
    """Say whose history ``folder`` is: the cluster's name, its file, and when it was kept."""
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f".{_RECORD}.part"
    part.write_text(json.dumps({"name": name, "file": str(cluster_file.expanduser().resolve()),
                                "kept_at": round(time.time(), 3)}))
    os.replace(part, folder / _RECORD)


@dataclass(frozen=True)
class KeptCluster:
    """A cluster's kept history: its name and file, its folder, and when `down` last kept it (Unix time)."""

    name: str
    file: str
    folder: Path
    kept_at: float

    @property
    def hosts(self) -> list[str]:
        """The hosts whose jobs are kept, by label (none where the folder went)."""
        try:
            return sorted(unquote(entry.name) for entry in self.folder.iterdir() if entry.is_dir())
        except OSError:
            return []

    def _answers(self) -> list[tuple[str, list[dict[str, Any]]]]:
        return [(label, past_jobs(_host_folder(self.folder, label), set())) for label in self.hosts]

    def rows(self) -> list[JobRow]:
        """Every kept job, newest first, one row per job as `distrun jobs` lists it."""
        return job_rows(self._answers())

    def records(self, job_id: str) -> list[tuple[str, JobRecord]]:
        """Each host's record of ``job_id`` (its log and result), in the job's rank order."""
        found = []
        for label in self.hosts:
            record = JobRecord.read_back(job_id, _host_folder(self.folder, label) / job_id)
            if record is not None and record.meta.get("ranks"):
                found.append((label, record))
        return sorted(found, key=lambda pair: pair[1].meta["ranks"][0])


def kept_clusters(home: str) -> tuple[KeptCluster, ...]:
    """Every cluster whose history `down` kept in ``home``, oldest first (a folder without its
    record, or with one that does not read, is left out)."""
    root = Path(home).expanduser() / HISTORY
    kept = []
    try:
        folders = [entry for entry in root.iterdir() if entry.is_dir()]
    except OSError:
        return ()
    for folder in folders:
        try:
            record = json.loads((folder / _RECORD).read_text())
            kept.append(KeptCluster(str(record["name"]), str(record["file"]), folder, float(record["kept_at"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return tuple(sorted(kept, key=lambda cluster: cluster.kept_at))
