"""Bringing a job's results home: its newest checkpoint from the host that wrote it.

Shared storage is not assumed: checkpoints are written on rank 0's host (under
``--checkpoint-dir`` there) and copied back over the same SSH connection.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from distrun.client._links import HostLink


def fetch_newest_checkpoint(link: HostLink, job_id: str, dest: Path) -> Path | None:
    """Copy the newest checkpoint ``job_id`` wrote on this host into ``dest``; None if it wrote none."""
    artifacts = link.call("artifacts", job=job_id)
    remote_path = artifacts.get("checkpoint")
    if not remote_path:
        return None
    data = link.remote.read_bytes(remote_path)
    dest = dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / PurePosixPath(remote_path).name
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    return target
