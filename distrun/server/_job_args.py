"""A job request's arguments, checked: ids, secrets, bundles, reasons, ports, and the files a job
left for the client to fetch. Every value here came over the wire from a client, so each is
held to its shape before it names a folder or reaches a process."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from distrun.errors import ConfigError
from distrun.protocol.secret import parse_job_secret

__all__ = ["JobError", "job_id_of", "reason_of", "secret_of", "sha_of", "port_range_of", "torchelastic_ids",
           "files_under", "traces_in"]

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class JobError(ValueError):
    """A request about a job cannot be honoured (unknown id, bad bundle, ...)."""


_ATTEMPT = re.compile(r"^(?P<run>.+?)(?:-r(?P<restart>\d+))?$")


def torchelastic_ids(attempt_id: str, max_restarts: int) -> dict[str, Any]:
    """torchrun's run id and restart count from an attempt id (JOB, then JOB-r1, JOB-r2, ...)."""
    found = _ATTEMPT.match(attempt_id)
    assert found is not None  # the pattern matches any non-empty id
    return {"run_id": found["run"], "restart_count": int(found["restart"] or 0), "max_restarts": max_restarts}


def job_id_of(args: dict[str, Any]) -> str:
    job_id = args.get("job")
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
        raise JobError(f"bad job id {job_id!r}")
    return job_id


def reason_of(args: dict[str, Any]) -> str:
    """Why a job is stopped, as the client said it: one short line."""
    text = " ".join(str(args.get("reason") or "cancelled").split())
    return text[:200] or "cancelled"


def secret_of(args: dict[str, Any]) -> str:
    try:
        parse_job_secret(args.get("secret"), "the request's secret")
    except ConfigError as exc:
        raise JobError(str(exc)) from None
    return str(args["secret"])


def sha_of(args: dict[str, Any]) -> str:
    sha = args.get("bundle")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise JobError(f"bad bundle id {sha!r}")
    return sha


def port_range_of(value: Any) -> tuple[int | None, int | None]:
    if value is None:
        return None, None
    low, high = int(value[0]), int(value[1])
    return low, high


def files_under(folder: Path) -> list[str]:
    """The files under ``folder`` (relative paths), for the client to fetch; none if it is absent."""
    if not folder.is_dir():
        return []
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def traces_in(folder: Path) -> list[str]:
    """The ``--profile`` traces the job's ranks wrote: finished (not a ``.tmp``), plain files, no links."""
    if not folder.is_dir():
        return []
    return sorted(path.name for path in folder.iterdir()
                  if path.name.endswith(".pt.trace.json") and not path.name.startswith(".")
                  and path.is_file() and not path.is_symlink())
