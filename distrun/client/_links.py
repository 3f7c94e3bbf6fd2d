"""One host of a running cluster, as a client uses it: its link, server state, control connection."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from distrun.client._server_client import ServerClient
from distrun.config import ClusterSpec, HostSpec
from distrun.errors import HostError
from distrun.protocol.cluster import ServerInfo, ServerState
from distrun.links import Remote
from distrun.scheduler import scheduler_for


def open_remote(cluster: ClusterSpec, host: HostSpec) -> Remote:
    """This machine for the embedded cluster, an srun link to a Slurm node, else SSH (opened on first use)."""
    return scheduler_for(cluster).link(host)


def read_server_state(remote: Remote, state_dir: str) -> ServerState | None:
    """The server's state file, or None if there is none (or a torn or foreign one: `up` replaces it)."""
    text = remote.read_file(f"{state_dir}/server.json")
    if text is None:
        return None
    try:
        return ServerState.from_json(text)
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested past the parser
        return None


def connect(remote: Remote, state: ServerState, label: str) -> ServerClient:
    """An authenticated connection to the server ``state`` describes."""
    return ServerClient(remote.open_stream(state.port), state.token, label)


@dataclass(frozen=True)
class Placement:
    """Where a block of ranks runs: ``slots`` processes on ``host`` from ``rank_offset``."""

    host: HostSpec
    slots: int
    rank_offset: int
    node_rank: int
    gpus: int


class HostLink:
    """The link to one host (SSH, srun or none), its server's state, and a lock for control calls."""

    def __init__(self, cluster: ClusterSpec, host: HostSpec) -> None:
        self.host = host
        self.label = host.label
        self.local = cluster.local
        self.state_dir = cluster.host_state_dir(host)
        self.remote = open_remote(cluster, host)
        self.state: ServerState | None = None
        self.info: ServerInfo | None = None
        self._control: ServerClient | None = None
        self._lock = threading.Lock()

    def open(self) -> None:
        self.state = read_server_state(self.remote, self.state_dir)
        if self.state is None and self.local:  # `distrun jobs`, `logs`, `stacks`, `cancel` of local jobs
            raise HostError(self.label, "no local server: local jobs are listed, followed, stacked and cancelled "
                                        "while `distrun up` (no file) runs here; start it, then the job")
        if self.state is None:
            raise HostError(self.label, "no worker server; run `distrun up` first")
        self._control = self.client()
        self.info, _ = self._control.status()

    def reopen(self) -> None:
        """Connect to the host's server again: a new one (``distrun up`` after a loss) has a new port and token."""
        with self._lock:
            if self._control is not None:
                self._control.close()
                self._control = None
            self.open()

    def wait_for_server(self, give_up: Callable[[], bool], poll_s: float = 1.0) -> bool:
        """Poll until this host's server answers again (``--elastic``: a lost host rejoins); False on ``give_up()``."""
        while not give_up():
            time.sleep(poll_s)
            try:
                self.reopen()
                return True
            except HostError:
                continue
        return False

    def client(self) -> ServerClient:
        assert self.state is not None, "open() first"
        return connect(self.remote, self.state, self.label)

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        with self._lock:
            return self._connected().call(op, **args)

    def call_waiting(self, op: str, wait_s: float, **args: Any) -> dict[str, Any]:
        """``call`` that waits up to ``wait_s`` for the answer (``ServerClient.call_waiting``)."""
        with self._lock:
            return self._connected().call_waiting(op, wait_s, **args)

    def _connected(self) -> ServerClient:
        """The control connection; a host error while there is none (``--elastic``: a lost host's
        server is being waited for, and a stop of the job reaches it there)."""
        if self._control is None:
            raise HostError(self.label, "no connection to its worker server (lost; not back yet)")
        return self._control

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


def holders_of(links: list[HostLink], job_id: str) -> list[tuple[HostLink, dict[str, Any]]]:
    """The links whose server knows ``job_id``, each with that server's record of it."""
    found = []
    for link in links:
        record = next((job for job in link.call("jobs")["jobs"] if job["job"] == job_id), None)
        if record is not None:
            found.append((link, record))
    return found
