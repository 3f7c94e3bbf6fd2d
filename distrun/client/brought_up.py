"""The clusters `distrun up` brought up from this machine: what `distrun dashboard` shows without a CLUSTER.

Nothing else on the client knows which cluster files are live (the servers know only their own
host), so a healthy `up CLUSTER` writes the file's absolute path here and a clean `down CLUSTER`
takes it out again. One small JSON file in ``$DISTRUN_HOME`` (``~/.distrun``, beside the local
server's state), rewritten whole under a lock and replaced atomically, so two `up`s at once
lose neither entry and a reader never sees half a file. It is a convenience, never a source of
truth: an entry whose file is gone is left out, and an unreadable record reads as empty.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BroughtUp", "RECORD", "brought_up", "forget", "remember"]

#: The record's file name in ``$DISTRUN_HOME``.
RECORD = "clusters.json"


@dataclass(frozen=True)
class BroughtUp:
    """A cluster file `up` brought up: its absolute path, the cluster's name, and when (Unix time)."""

    file: str
    name: str
    up_at: float


def brought_up(home: str) -> tuple[BroughtUp, ...]:
    """The clusters recorded in ``home``, oldest first, leaving out those whose file is gone."""
    return tuple(entry for entry in _read(_record(home)) if Path(entry.file).is_file())


def remember(home: str, cluster_file: Path, name: str) -> None:
    """Record ``cluster_file`` as brought up (again: its time is renewed). OSError when ``home`` is not writable."""
    path = str(cluster_file.expanduser().resolve())
    with _locked(_record(home)) as record:
        entries = [entry for entry in _read(record) if entry.file != path]
        _write(record, [*entries, BroughtUp(path, name, round(time.time(), 3))])


def forget(home: str, cluster_file: Path) -> None:
    """Take ``cluster_file`` out of the record (nothing when it is not there)."""
    path = str(cluster_file.expanduser().resolve())
    record = _record(home)
    if not record.exists():
        return
    with _locked(record):
        entries = _read(record)
        if any(entry.file == path for entry in entries):
            _write(record, [entry for entry in entries if entry.file != path])


def _record(home: str) -> Path:
    return Path(home).expanduser() / RECORD


@contextlib.contextmanager
def _locked(record: Path) -> Iterator[Path]:
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record.with_name(RECORD + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield record
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(record: Path) -> list[BroughtUp]:
    try:
        data = json.loads(record.read_text())
        return [BroughtUp(str(item["file"]), str(item["name"]), float(item["up_at"])) for item in data["clusters"]]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # absent or unreadable: nothing recorded
        return []


def _write(record: Path, entries: list[BroughtUp]) -> None:
    temporary = record.with_name(f".{RECORD}.{os.getpid()}")
    temporary.write_text(json.dumps({"clusters": [vars(entry) for entry in entries]}, indent=1) + "\n")
    os.replace(temporary, record)
