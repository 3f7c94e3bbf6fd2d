"""A local job, listed on this machine's server while `distrun up` runs here.

The `distrun train` process supervises a local job itself; nothing of it is the server's. So
that `distrun jobs`, `logs`, `attach`, `stacks` and `cancel` reach it from another terminal,
as they reach a cluster job, the client opens one connection to the local server and lists
the job there (the server's side: ``server/_local_job``). Over it go the launcher's events (the
server keeps them as a cluster host keeps its ranks'), and at the end the result. Back come
a canceller's stop (with its reason) and a `distrun stacks` request, which this process
answers: it is the tracer its ranks allow.

Listing is best effort: a job whose server cannot be reached, or goes away, trains on as if
there were no server, and its own output is unchanged.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from distrun._version import __version__
from distrun.client._links import connect, open_remote, read_server_state
from distrun.config import ClusterSpec
from distrun.errors import HostError
from distrun.protocol import Event, event_to_dict
from distrun.protocol.wire import Stream, WireError, close, recv_frame, send_frame

__all__ = ["Listing", "list_on_local_server"]

#: Events waiting for the server; past this many (a server that stopped reading) the listing ends.
_BACKLOG = 20_000
#: How long the end of a job waits for its last events and result to reach the server.
_FLUSH_S = 2.0


class Listing:
    """One local job on the local server: ``put`` its events, ``end`` with its result."""

    def __init__(self, stream: Stream, job_id: str, host: str) -> None:
        self.job_id = job_id
        self.host = host  # the local server's host label, as `distrun jobs` names it
        self._stream = stream
        self._outbox: queue.Queue[dict[str, Any] | None] = queue.Queue(_BACKLOG)
        self._send_lock = threading.Lock()
        self._stop: Callable[[str], None] = lambda _reason: None
        self._diagnose: Callable[[bool, bool], dict[str, Any]] = lambda _native, _dumps: {}
        self._sender = threading.Thread(target=self._send_all, name="distrun-listing", daemon=True)
        self._reader = threading.Thread(target=self._read_all, name="distrun-listing-requests", daemon=True)

    def start(self, *, stop: Callable[[str], None], diagnose: Callable[[bool, bool], dict[str, Any]]) -> None:
        """``stop(reason)``: `distrun cancel` from elsewhere; ``diagnose(native, flight_recorder)``:
        `distrun stacks`, answered as a host's ``diagnose`` ({"stacks", "dumps"})."""
        self._stop, self._diagnose = stop, diagnose
        self._sender.start()
        self._reader.start()

    def put(self, event: Event) -> None:
        try:
            self._outbox.put_nowait({"event": event_to_dict(event)})
        except queue.Full:  # the server stopped reading: the job goes on unlisted
            self._close()

    def end(self, result: dict[str, Any]) -> None:
        """The job's result (a host's shape: state, failure, reason, warm), then close."""
        try:
            self._outbox.put_nowait({"end": result})
            self._outbox.put_nowait(None)
        except queue.Full:
            self._close()
            return
        self._sender.join(_FLUSH_S)
        self._close()

    # -- threads

    def _send_all(self) -> None:
        while True:
            frame = self._outbox.get()
            if frame is None or not self._send(frame):
                return

    def _read_all(self) -> None:
        while True:
            try:
                request = recv_frame(self._stream)
            except (WireError, OSError):
                return  # closed: by us at the end, or the server stopped
            if request.get("op") == "stop":
                self._stop(str(request.get("reason") or "cancelled"))
            elif request.get("op") == "diagnose" and isinstance(request.get("id"), int):
                threading.Thread(target=self._answer, args=(request,), daemon=True).start()

    def _answer(self, request: dict[str, Any]) -> None:
        try:
            answer = self._diagnose(bool(request.get("native")), bool(request.get("flight_recorder")))
        except Exception as exc:  # noqa: BLE001 - the asker gets the reason, the job goes on
            answer = {"stacks": [{"rank": -1, "host": self.host, "pid": 0, "error": str(exc)}], "dumps": {}}
        self._send({"reply": request["id"], **answer})

    def _send(self, frame: dict[str, Any]) -> bool:
        try:
            with self._send_lock:
                send_frame(self._stream, frame)
            return True
        except (WireError, OSError, ValueError):
            self._close()
            return False

    def _close(self) -> None:
        close(self._stream)


def list_on_local_server(cluster: ClusterSpec, job_id: str, meta: dict[str, Any]) -> Listing | None:
    """List ``job_id`` on this machine's server (``cluster``: the embedded local one); None when
    no server runs here, or one of another distrun version, or it refuses."""
    if not cluster.local:
        raise ValueError("a job is listed on the embedded local server only")
    host = cluster.hosts[0]
    remote = open_remote(cluster, host)
    state = read_server_state(remote, cluster.host_state_dir(host))
    if state is None or state.version != __version__:
        return None
    try:
        client = connect(remote, state, host.label)
    except HostError:
        return None
    try:
        stream = client.hand_over("local_job", job=job_id, pid=os.getpid(), **meta)
    except HostError:
        client.close()
        return None
    return Listing(stream, job_id, host.label)
