"""What a worker server reports about itself, and the per-host rows of up/status/down.

``ServerInfo`` crosses the wire as JSON (the server's answer to ``status``);
``HostRow`` and ``ClusterReport`` are what the client hands to the table
renderer and to ``--json``. All are immutable snapshots.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any

from distrun.errors import HostError

__all__ = ["ServerState", "GpuReading", "ServerInfo", "HostStatus", "HostRow", "ClusterReport", "config_digest"]


@dataclass(frozen=True)
class ServerState:
    """What a client needs to reach a server: read over SFTP, never sent over the network."""

    pid: int
    port: int
    token: str  # hex
    version: str
    protocol: int
    started_at: float
    config_sha256: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServerState:
        data: dict[str, Any] = json.loads(text)
        return cls(**{key: data[key] for key in cls.__dataclass_fields__})


@dataclass(frozen=True)
class GpuReading:
    """One GPU as NVML read it when the server answered ``status``: utilisation over NVML's last sample
    period (percent) and memory in use and in all (bytes)."""

    index: int
    name: str
    util_pct: float
    memory_used_bytes: int
    memory_total_bytes: int


@dataclass(frozen=True)
class ServerInfo:
    version: str
    protocol: int
    pid: int
    state_dir: str
    hostname: str
    python: str
    started_at: float  # Unix time
    uptime_s: float
    cpu_count: int
    memory_total_bytes: int
    memory_available_bytes: int
    load_1m: float
    gpu_count: int
    gpu_names: tuple[str, ...]
    jobs_running: int
    config_sha256: str
    warm: bool  # the warm interpreter (torch imported) is ready to fork training processes
    #: The host's GPUs read through NVML, and ``gpu_note``: why there are none (``NVML not found: ...``);
    #: None from a server that does not read them (an older one).
    gpus: tuple[GpuReading, ...] = ()
    gpu_note: str | None = None
    #: CPU use over every core since the server's previous ``status`` (percent); None on its first.
    cpu_pct: float | None = None
    #: The Python environment `up` built that the server runs in (``workdir/.envs/<name>``, issue
    #: 49): its name; None: the host's python as it is (or an older server, which does not say).
    environment: str | None = None
    #: The jobs running on this server now: (job id, recipe file name) each, for the dashboard's hosts
    #: page (the count is ``jobs_running``); empty from an older server.
    running_jobs: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gpu_names"] = list(self.gpu_names)
        data["gpus"] = [asdict(gpu) for gpu in self.gpus]
        data["running_jobs"] = [{"job": job, "recipe": recipe} for job, recipe in self.running_jobs]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServerInfo:
        names = {f.name for f in fields(cls)}
        missing = names - data.keys() - _OPTIONAL
        if missing:
            raise ValueError(f"server status lacks {sorted(missing)}")
        values = {key: data[key] for key in names if key in data}
        values["gpu_names"] = tuple(values["gpu_names"])
        values["gpus"] = tuple(GpuReading(**gpu) for gpu in values.get("gpus") or ())
        values["running_jobs"] = tuple((str(job.get("job", "?")), str(job.get("recipe", "?")))
                                       for job in values.get("running_jobs") or () if isinstance(job, dict))
        return cls(**values)


#: ServerInfo's fields an older server does not send.
_OPTIONAL = frozenset({"gpus", "gpu_note", "cpu_pct", "environment", "running_jobs"})


class HostStatus(str, Enum):
    UP = "up"  # a healthy server answered (kept by an idempotent `up`)
    STARTED = "started"  # `up` started a server
    RESTARTED = "restarted"  # `up` replaced a dead or stale server
    STOPPED = "stopped"  # `down` stopped the server and found nothing of distrun's left
    NOT_RUNNING = "not running"  # no server (status), or nothing to stop (down)
    DOWN = "down"  # the host cannot be reached or logged into
    ERROR = "error"  # reached, but something failed there (message says what)

    @property
    def healthy(self) -> bool:
        return self in (HostStatus.UP, HostStatus.STARTED, HostStatus.RESTARTED)


@dataclass(frozen=True)
class HostRow:
    host: str
    roles: tuple[str, ...]
    status: HostStatus
    message: str = ""
    slots: int | None = None
    server: ServerInfo | None = None
    rtt_ms: float | None = None
    processes_left: int | None = None  # after `down`: processes of distrun's still alive (0 = checked clean)
    exit_code: int = 0  # the exit code of the error behind this row (HostError 6, HostKeyError 7)

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "roles": list(self.roles),
            "status": self.status.value,
            "message": self.message,
            "slots": self.slots,
            "rtt_ms": self.rtt_ms,
            "processes_left": self.processes_left,
            "exit_code": self.exit_code,
            "server": self.server.to_dict() if self.server else None,
        }


@dataclass(frozen=True)
class ClusterReport:
    cluster: str
    command: str  # up | status | down
    rows: tuple[HostRow, ...]

    @property
    def ok(self) -> bool:
        return not self.failed_rows

    @property
    def failed_rows(self) -> tuple[HostRow, ...]:
        """The hosts that did not end as the command wants (up; for `down`, clean), each judged by its
        own row: one host that failed never makes another's clean `down` read as "not clean"."""
        if self.command == "down":
            return tuple(row for row in self.rows
                         if row.status not in (HostStatus.STOPPED, HostStatus.NOT_RUNNING) or row.processes_left)
        return tuple(row for row in self.rows if not row.status.healthy)

    @property
    def exit_code(self) -> int:
        """0 when ok; else the most serious row's code (a refused host key outranks the rest)."""
        if self.ok:
            return 0
        return max((row.exit_code for row in self.rows), default=0) or HostError.exit_code

    def to_dict(self) -> dict[str, Any]:
        return {"type": "cluster", "cluster": self.cluster, "command": self.command, "ok": self.ok,
                "hosts": [row.to_dict() for row in self.rows]}


def config_digest(config: dict[str, Any]) -> str:
    """sha256 of a server's start configuration, so `up` can tell a stale server from a current one."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
