"""One host of a running cluster, as a client uses it: SSH link, server state, control connection."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distrun.client._server_client import ServerClient
from distrun.config import ClusterSpec, HostSpec
from distrun.errors import HostError
from distrun.protocol.cluster import ServerInfo, ServerState
from distrun.ssh import Connection, LocalConnection, Remote


class HostLink:
    """The SSH connection to one host, its server's state, and a lock for control calls."""

    def __init__(self, cluster: ClusterSpec, host: HostSpec) -> None:
        self.host = host
        self.label = host.label
        self.state_dir = cluster.host_state_dir(host)
        self.remote: Remote = LocalConnection(self.label) if cluster.local else Connection(host)
        self.state: ServerState | None = None
        self.info: ServerInfo | None = None
        self._control: ServerClient | None = None
        self._lock = threading.Lock()

    def open(self) -> None:
        text = self.remote.read_file(f"{self.state_dir}/server.json")
        if text is None:
            raise HostError(self.label, "no worker server; run `distrun up` first")
        self.state = ServerState.from_json(text)
        self._control = self.client()
        self.info, _ = self._control.status()

    def client(self) -> ServerClient:
        assert self.state is not None
        return ServerClient(self.remote.open_stream(self.state.port), self.state.token, self.label)

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self._control is not None
        with self._lock:
            return self._control.call(op, **args)

    def close(self) -> None:
        if self._control is not None:
            self._control.close()
        self.remote.close()


def open_all(links: list[HostLink]) -> None:
    if not links:
        return
    try:
        with ThreadPoolExecutor(max_workers=min(32, len(links))) as pool:
            list(pool.map(lambda link: link.open(), links))
    except BaseException:
        for link in links:
            link.close()
        raise
