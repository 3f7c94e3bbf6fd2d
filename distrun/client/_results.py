"""Bringing a job's results home: its newest checkpoint, its summary, its TensorBoard files and
every host's --profile traces.

Shared storage is not assumed: checkpoints are written on rank 0's host (under
``--checkpoint-dir`` there) and copied back over the same SSH connection.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

from distrun.client._links import HostLink
from distrun.config import JobSpec
from distrun.errors import HostError
from distrun.protocol import JobSummary


def artifacts(link: HostLink, job_id: str) -> dict:
    """What ``job_id`` left on this host: its newest checkpoint and its ``--tensorboard`` files (one call)."""
    return link.call("artifacts", job=job_id)


#: What a checkpoint may be called (a plain file, or a sharded checkpoint's folder), and what a
#: file inside such a folder may be called: a server's answer names them, and nothing it names
#: may reach outside the folder the client writes into.
CHECKPOINT_NAME = re.compile(r"^ckpt-\d+(\.pt)?$")
_PART_NAME = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.-]{1,128}$")


def checkpoint_parts(link: HostLink, answer: dict) -> tuple[str, str, list[str] | None] | None:
    """(remote path, its name, the folder's file names or None for one file) from an
    ``artifacts`` answer, every name checked; None when the job wrote no checkpoint there."""
    remote_path = answer.get("checkpoint")
    if not remote_path:
        return None
    name = PurePosixPath(str(remote_path)).name
    parts = answer.get("checkpoint_files")
    bad = [n for n in ([name] if not CHECKPOINT_NAME.match(name) else [])
           + [str(p) for p in (parts or ()) if not isinstance(p, str) or not _PART_NAME.match(p)]]
    if bad or (parts is not None and not isinstance(parts, list)):
        raise HostError(link.label, f"the server named a checkpoint file distrun does not write: {bad[:3]!r}")
    return str(remote_path), name, parts


def fetch_newest_checkpoint(link: HostLink, job_id: str, dest: Path, found: dict | None = None) -> Path | None:
    """Copy the newest checkpoint ``job_id`` wrote on this host into ``dest``; None if it wrote none.
    ``found``: the host's ``artifacts`` answer, where the caller already has it."""
    named = checkpoint_parts(link, found if found is not None else artifacts(link, job_id))
    if named is None:
        return None
    remote_path, name, parts = named
    dest = dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / name
    tmp = dest / f".{name}.tmp"
    if parts is None:  # one file
        tmp.write_bytes(link.remote.read_bytes(remote_path))
        os.replace(tmp, target)
        return target
    shutil.rmtree(tmp, ignore_errors=True)  # a sharded checkpoint's folder: each file, then the folder whole
    tmp.mkdir()
    for part in parts:
        (tmp / part).write_bytes(link.remote.read_bytes(f"{remote_path}/{part}"))
    old = dest / f".{name}.old"
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
    return target


def fetch_tensorboard(link: HostLink, job_id: str, dest: Path, found: dict | None = None) -> list[Path]:
    """Copy the ``--tensorboard`` event files ``job_id`` wrote on this host into ``dest`` (same layout).
    ``found``: the host's ``artifacts`` answer, where the caller already has it."""
    return fetch_folder(link, (found if found is not None else artifacts(link, job_id)).get("tensorboard") or {}, dest)


def fetch_profile(link: HostLink, job_id: str, dest: Path, found: dict | None = None) -> list[Path]:
    """Copy the ``--profile`` traces this host's ranks wrote into ``dest`` (each is named by its rank)."""
    return fetch_folder(link, (found if found is not None else artifacts(link, job_id)).get("profile") or {}, dest)


def fetch_folder(link: HostLink, board: dict, dest: Path) -> list[Path]:
    """Copy the files an ``artifacts`` answer names under one of the job's folders into ``dest``."""
    fetched = []
    for name in board.get("files", ()):
        relative = PurePosixPath(str(name))
        # a server names files under its own folder only: nothing absolute, no "..", not the folder itself
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            continue
        target = dest.resolve() / Path(*relative.parts)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_bytes(link.remote.read_bytes(f"{board['dir']}/{name}"))
            os.replace(tmp, target)
        except OSError as exc:
            raise HostError(link.label, f"{name} not copied into {target.parent}: {exc.strerror or exc}") from None
        fetched.append(target)
    return fetched


def fetch_job_results(links: list[HostLink], job_id: str, attempts: list[str], current: str, spec: JobSpec | None,
                      dest: Path, summary: JobSummary) -> dict[str, Any]:
    """Copy the newest checkpoint (from rank 0's host, ``links[0]``) and the summary into ``dest``,
    the ``--tensorboard`` files into their folder, and every host's ``--profile`` traces of every
    attempt (``attempts``) into ``dest``/profile: the ``results`` line. ``current``: the attempt
    that ran last (a restart whose submit failed never ran: it is not this one)."""
    dest = dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
    found = artifacts(links[0], current)  # one call for the checkpoint and the board
    checkpoint = fetch_newest_checkpoint(links[0], current, dest, found)
    board = None
    if spec is not None and spec.observe.tensorboard_dir:  # --tensorboard DIR: the chief's files, home
        board = Path(spec.observe.tensorboard_dir)
        fetch_tensorboard(links[0], current, board, found)
    traces: list[Path] = []
    missed: list[str] = []
    if spec is not None and spec.observe.profile_steps:  # a restart may have run the window: every attempt
        for link in links:
            for attempt in attempts:
                try:
                    known = found if link is links[0] and attempt == current else None
                    traces += fetch_profile(link, attempt, dest / "profile", known)
                except HostError as exc:
                    if attempt == current:  # an older attempt a host never ran is not news
                        missed.append(f"{link.label}: {exc.reason}")
    return {"type": "results", "job": job_id, "dir": str(dest),
            "checkpoint": str(checkpoint) if checkpoint else None, "tensorboard": str(board) if board else None,
            "profile": str(dest / "profile") if traces else None,
            "profile_traces": sorted(str(path) for path in traces), "profile_missed": missed}
