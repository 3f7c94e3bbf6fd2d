"""The worker server: a loopback listener that authenticates, then answers requests.

It holds no model code and never imports torch: it starts training processes
(through ``distrun.launch``) for jobs it is sent. Because it will run shipped
code, every connection must pass the HMAC handshake of ``protocol.wire`` before
anything else is read, and the handshake itself gets a deadline and a
length-capped frame, so raw bytes, a wrong token, an oversized frame or a silent
peer cost one short-lived thread and nothing more.
"""

from __future__ import annotations

import logging
import os
import platform
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from distrun._version import __version__
from distrun.protocol.cluster import ServerInfo
from distrun.protocol.wire import PROTOCOL_VERSION, WireError, recv_frame, send_frame, server_handshake
from distrun.server._doctor import ProbeListener, doctor_facts, environment_name
from distrun.server._hostinfo import gpu_names, gpu_readings, host_facts
from distrun.server._jobs import JobError, JobManager
from distrun.server._net import address_to_bind
from distrun.server._warm import WarmInterpreter
from distrun.protocol.cluster import ServerState
from distrun.server._state import StateDir

log = logging.getLogger("distrun.server")

#: A peer has this long to complete the handshake.
HANDSHAKE_TIMEOUT_S = 10.0
#: Connections still in the handshake at once; a new one beyond this evicts the oldest.
MAX_PENDING_HANDSHAKES = 32
#: An authenticated connection idle this long is closed (clients reconnect).
IDLE_TIMEOUT_S = 3600.0
_ACCEPT_POLL_S = 0.5

Handler = Callable[[dict[str, Any]], dict[str, Any]]
Stream = Callable[[dict[str, Any]], Iterator[dict[str, Any]]]


class _PendingHandshakes:
    """Connections not yet authenticated, oldest first; admitting one past the bound evicts the oldest.

    Refusing new connections when full would let a flood of silent ones (each allowed
    HANDSHAKE_TIMEOUT_S) lock the real client out. Evicting the oldest instead keeps
    every slot turning over: a real client needs its slot for the milliseconds of its
    handshake, a flooder's connections are the oldest by then.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}  # insertion order: oldest first

    def admit(self, conn: socket.socket) -> None:
        with self._lock:
            while len(self._conns) >= self._limit:
                _key, oldest = next(iter(self._conns.items()))
                del self._conns[_key]
                try:
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread's read ends now; that thread closes it
                except OSError:
                    pass
            self._conns[id(conn)] = conn

    def release(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.pop(id(conn), None)


class WorkerServer:
    def __init__(self, state_dir: StateDir, *, config_sha256: str) -> None:
        self.state_dir = state_dir
        self.config_sha256 = config_sha256
        self.token = secrets.token_bytes(32)
        self.started_at = time.time()
        self._started_monotonic = time.monotonic()
        self._stop = threading.Event()
        self._pending = _PendingHandshakes(MAX_PENDING_HANDSHAKES)
        self._gpu_names = gpu_names()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.warm = WarmInterpreter(state_dir.path)
        self.jobs = JobManager(state_dir.path, self.warm.starter)
        self._handlers: dict[str, Handler] = {
            "status": self._status,
            "warm": lambda _args: self.warm.describe(),
            "shutdown": self._shutdown,
            "has_bundle": self.jobs.has_bundle,
            "rendezvous": self.jobs.rendezvous,
            "submit": self.jobs.submit,
            "stopping": self.jobs.stopping,
            "cancel": self.jobs.cancel,
            "lose_rank": self.jobs.lose_rank,
            "doctor": self._doctor,
            "doctor_listen": self._doctor_listen,
            "jobs": self.jobs.list,
            "artifacts": self.jobs.artifacts,
            "diagnose": self.jobs.diagnose,
        }
        # Requests answered by a stream of frames, ended by {"end": true}.
        self._streams: dict[str, Stream] = {"follow": self.jobs.follow}

    # -- lifecycle

    def bind(self) -> int:
        """Listen on the host's loopback only, on a port the OS picks; return it."""
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(_ACCEPT_POLL_S)
        return int(self._listener.getsockname()[1])

    def state(self) -> ServerState:
        return ServerState(pid=os.getpid(), port=int(self._listener.getsockname()[1]), token=self.token.hex(),
                           version=__version__, protocol=PROTOCOL_VERSION, started_at=self.started_at,
                           config_sha256=self.config_sha256)

    def serve_forever(self) -> None:
        """Accept until shutdown or SIGTERM; then remove the state file."""
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda *_: self._stop.set())
        # Slurm's warning before a time limit (--signal=USR1@N): passed on to the jobs, from a
        # thread of its own (the handler may interrupt a holder of the jobs' lock).
        signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=self.jobs.preempt_all, daemon=True).start())
        log.info("serving on 127.0.0.1:%d (pid %d, distrun %s)", self.state().port, os.getpid(), __version__)
        self.warm.start()
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self._stop.is_set():
                        break
                    raise
                self._pending.admit(conn)
                threading.Thread(target=self._serve_connection, args=(conn,), daemon=True).start()
        finally:
            self._listener.close()
            self.jobs.stop_all("the worker server is stopping")
            self.warm.stop()
            self.state_dir.remove_if_ours(os.getpid())
            log.info("stopped")

    def stop(self) -> None:
        self._stop.set()

    # -- connections

    def _serve_connection(self, conn: socket.socket) -> None:
        authenticated = False
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                server_handshake(conn, self.token, {"version": __version__, "pid": os.getpid()})
            finally:
                self._pending.release(conn)
            authenticated = True
            conn.settimeout(IDLE_TIMEOUT_S)
            while not self._stop.is_set():
                request = recv_frame(conn)
                if request.get("op") == "local_job":  # the connection is the job's from now on
                    self.jobs.local_job(conn, request)
                    return
                if request.get("op") in self._streams:
                    self._stream(conn, request)
                else:
                    send_frame(conn, self._dispatch(request))
        except (WireError, OSError) as exc:
            if not authenticated:
                log.warning("refused a connection: %s", exc)
        finally:
            conn.close()

    def _dispatch(self, request: dict[str, Any]) -> dict[str, Any]:
        request_id = request.get("id")
        op = request.get("op")
        handler = self._handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            return {"id": request_id, "ok": False,
                    "error": {"type": "UnknownOp", "message": f"unknown request {op!r}; known: {sorted(self._handlers)}"}}
        args = request.get("args") or {}
        try:
            return {"id": request_id, "ok": True, "result": handler(args if isinstance(args, dict) else {})}
        except Exception as exc:  # a bad request must not take the server down
            log.exception("request %r failed", op)
            return {"id": request_id, "ok": False, "error": {"type": type(exc).__name__, "message": str(exc)}}

    def _stream(self, conn: socket.socket, request: dict[str, Any]) -> None:
        request_id = request.get("id")
        args = request.get("args") if isinstance(request.get("args"), dict) else {}
        try:
            for item in self._streams[str(request["op"])](args):
                send_frame(conn, {"id": request_id, "ok": True, "item": item})
        except (WireError, OSError):
            raise
        except Exception as exc:
            send_frame(conn, {"id": request_id, "ok": False, "error": {"type": type(exc).__name__, "message": str(exc)}})
            return
        send_frame(conn, {"id": request_id, "ok": True, "end": True})

    # -- requests

    def _status(self, _args: dict[str, Any]) -> dict[str, Any]:
        gpus, gpu_note = gpu_readings()
        running = self.jobs.running_jobs()  # one read: the count and the names agree
        info = ServerInfo(
            version=__version__, protocol=PROTOCOL_VERSION, pid=os.getpid(), state_dir=str(self.state_dir.path),
            hostname=socket.gethostname(), python=platform.python_version(), started_at=self.started_at,
            uptime_s=time.monotonic() - self._started_monotonic, gpu_count=len(self._gpu_names),
            gpu_names=self._gpu_names, jobs_running=len(running), running_jobs=running,
            config_sha256=self.config_sha256,
            warm=self.warm.ready, gpus=gpus, gpu_note=gpu_note, environment=environment_name(sys.executable),
            **host_facts(),  # type: ignore[arg-type]
        )
        return info.to_dict()

    def _doctor(self, args: dict[str, Any]) -> dict[str, Any]:
        """``distrun doctor``: this host's facts, and whether it reaches the chief's probe port.
        ``clock_only``: just the time, answered at once (the client measures skew with it)."""
        if args.get("clock_only"):
            return {"time": time.time()}
        chief = args.get("chief")
        port = args.get("port")
        installer = args.get("installer")
        return doctor_facts(self.state_dir.path, str(chief) if chief else None,
                            int(port) if isinstance(port, int) and not isinstance(port, bool) else None,
                            installer=installer if installer in ("auto", "uv", "pip") else "auto")

    def _doctor_listen(self, args: dict[str, Any]) -> dict[str, Any]:
        """``distrun doctor`` on the chief: a port that accepts for a while, as the rendezvous will."""
        raw = args.get("port_range")
        port_range = (int(raw[0]), int(raw[1])) if isinstance(raw, list) and len(raw) == 2 else None
        address = address_to_bind(str(args.get("address") or "127.0.0.1"), args.get("interface"))
        if address is None:
            raise JobError(f"cannot tell this host's cluster address from {args.get('address')!r}")
        return {"port": ProbeListener(address, port_range, lifetime_s=30.0).port}

    def _shutdown(self, _args: dict[str, Any]) -> dict[str, Any]:
        # Reply first; the accept loop notices within _ACCEPT_POLL_S and exits.
        threading.Timer(0.05, self._stop.set).start()
        return {"stopping": True, "pid": os.getpid()}
