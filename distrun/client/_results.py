"""Bringing a job's results home: its newest checkpoint and its TensorBoard files.

Shared storage is not assumed: checkpoints are written on rank 0's host (under
``--checkpoint-dir`` there) and copied back over the same SSH connection.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path, PurePosixPath

from distrun.client._links import HostLink


def artifacts(link: HostLink, job_id: str) -> dict:
    """What ``job_id`` left on this host: its newest checkpoint and its ``--tensorboard`` files (one call)."""
    return link.call("artifacts", job=job_id)


def fetch_newest_checkpoint(link: HostLink, job_id: str, dest: Path, found: dict | None = None) -> Path | None:
    """Copy the newest checkpoint ``job_id`` wrote on this host into ``dest``; None if it wrote none.
    ``found``: the host's ``artifacts`` answer, where the caller already has it."""
    answer = found if found is not None else artifacts(link, job_id)
    remote_path = answer.get("checkpoint")
    if not remote_path:
        return None
    dest = dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / PurePosixPath(remote_path).name
    tmp = target.with_name(f".{target.name}.tmp")
    parts = answer.get("checkpoint_files")
    if parts is None:  # one file
        tmp.write_bytes(link.remote.read_bytes(remote_path))
    else:  # a sharded checkpoint's folder: each file, then the folder appears whole
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name in parts:
            if "/" in name or name in (".", ".."):  # a server names files in the folder only
                continue
            (tmp / name).write_bytes(link.remote.read_bytes(f"{remote_path}/{name}"))
        if target.exists():
            shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def fetch_tensorboard(link: HostLink, job_id: str, dest: Path, found: dict | None = None) -> list[Path]:
    """Copy the ``--tensorboard`` event files ``job_id`` wrote on this host into ``dest`` (same layout).
    ``found``: the host's ``artifacts`` answer, where the caller already has it."""
    board = (found if found is not None else artifacts(link, job_id)).get("tensorboard") or {}
    fetched = []
    for name in board.get("files", ()):
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts:  # a server names files under its own folder only
            continue
        target = dest.resolve() / Path(*relative.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(link.remote.read_bytes(f"{board['dir']}/{name}"))
        os.replace(tmp, target)
        fetched.append(target)
    return fetched
