"""Hosts the cluster file lists: SSH to each, or this machine for the embedded default."""

from __future__ import annotations

import json
from typing import Any

from distrun.config import ClusterSpec, HostSpec
from distrun.links import Connection, LocalConnection, Remote, Result
from distrun.scheduler.api import Progress, quiet

__all__ = ["StaticHosts"]


class StaticHosts:
    """The file's ``hosts:``. A server is started detached (``start``): it outlives the SSH session."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster

    def resolve(self, *, allocate: bool = False, progress: Progress = quiet) -> ClusterSpec:
        return self.cluster

    def link(self, host: HostSpec) -> Remote:
        return LocalConnection(host.label) if self.cluster.local else Connection(host)

    def start_server(self, remote: Remote, host: HostSpec, state_dir: str, config: dict[str, Any]) -> Result:
        argv = [host.python, "-m", "distrun.server", "start", "--state-dir", state_dir]
        return remote.run(argv, stdin=json.dumps(config))

    def ended(self) -> str | None:
        return None  # listed hosts do not end; a lost one is named by its link

    def close(self) -> None:
        pass

    def release(self) -> str | None:
        return None
