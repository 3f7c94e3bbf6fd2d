"""How a launcher starts one training process: a fresh interpreter, or a fork of a warm one.

``PopenStarter`` execs ``python -m distrun.runtime`` (cold: the interpreter
starts and imports torch). ``ZygoteStarter`` asks a zygote (``_zygote.py``), a
process that imported torch once, to fork the training process instead, so it
skips interpreter start-up and the torch import. Both hand back a handle with
the ``subprocess.Popen`` surface the launcher uses (``pid``, ``poll()``,
``wait()``), and both give the process the same pipes, environment, folder and
session, so supervision does not know the difference.
"""

from __future__ import annotations

import array
import json
import os
import socket
import subprocess
from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["Handle", "Starter", "PopenStarter", "ZygoteStarter", "ZygoteUnavailable"]

_MAX_REPLY_BYTES = 4096


class Handle(Protocol):
    pid: int

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...


class Starter(Protocol):
    #: forks a warm interpreter (the zygote), rather than starting a fresh one
    warm: bool

    def parent_pid(self) -> int:
        """The pid the process's parent will have (what PR_SET_PDEATHSIG watches)."""
        ...

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, *, stdout: int, stderr: int,
              pass_fds: Sequence[int]) -> Handle: ...

    def cold(self) -> Starter:
        """This starter as it starts processes once the warm interpreter is gone."""
        ...


class PopenStarter:
    warm = False

    def parent_pid(self) -> int:
        return os.getpid()

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, *, stdout: int, stderr: int,
              pass_fds: Sequence[int]) -> Handle:
        return subprocess.Popen(  # noqa: S603 - argv list, no shell
            list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            pass_fds=tuple(pass_fds), start_new_session=True,
        )

    def cold(self) -> PopenStarter:
        return self


class ZygoteUnavailable(RuntimeError):
    """The zygote is gone or refused; the caller falls back to a cold start."""


class _ZygoteHandle:
    """A process the zygote forked: its exit status arrives as one line on our connection."""

    def __init__(self, conn: socket.socket, pid: int, pending: bytes, zygote_pid: int) -> None:
        self._conn = conn
        self.pid = pid
        self.returncode: int | None = None
        self._pending = pending
        self._zygote_pid = zygote_pid
        #: Why it ended, when the cause was the zygote's end rather than its own (else None).
        self.lost_reason: str | None = None

    def _read(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if b"\n" not in self._pending:
            self._conn.settimeout(timeout)
            try:
                data = self._conn.recv(_MAX_REPLY_BYTES)
            except (BlockingIOError, TimeoutError):
                return None
            except OSError:
                data = b""
            self._pending += data
            if data and b"\n" not in self._pending:
                return None
        # The zygote sends {"exit": code} and closes; a dead zygote closes without it
        # (its children die with it: PR_SET_PDEATHSIG), which we report as SIGKILL.
        line = self._pending.split(b"\n", 1)[0]
        try:
            self.returncode = int(json.loads(line.decode())["exit"]) if line else -9
        except (ValueError, KeyError):
            self.returncode = -9
        if not line:
            self.lost_reason = (f"killed with the warm interpreter it was forked from (pid {self._zygote_pid}): "
                                "its worker server stopped (`distrun down`?)")
        self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._read(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        return code


class ZygoteStarter:
    """Forks training processes from the zygote listening on ``socket_path``."""

    warm = True

    def __init__(self, socket_path: str, zygote_pid: int) -> None:
        self.socket_path = socket_path
        self.zygote_pid = zygote_pid

    def parent_pid(self) -> int:
        return self.zygote_pid

    def cold(self) -> PopenStarter:
        return PopenStarter()

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, *, stdout: int, stderr: int,
              pass_fds: Sequence[int]) -> Handle:
        fds = [stdout, stderr, *pass_fds]
        targets = [1, 2, *pass_fds]  # passed fds keep their numbers, as with Popen(pass_fds=...)
        # No cwd means ours, as with Popen: the zygote's own folder is not the caller's.
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd(),
                              "targets": targets}).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(10.0)
            conn.connect(self.socket_path)
            conn.sendmsg([len(request).to_bytes(4, "big") + request],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            reply = b""
            while b"\n" not in reply:
                chunk = conn.recv(_MAX_REPLY_BYTES)
                if not chunk:
                    raise OSError("the zygote closed the connection")
                reply += chunk
            line, rest = reply.split(b"\n", 1)
            pid = int(json.loads(line.decode())["pid"])
        except (OSError, ValueError, KeyError) as exc:
            conn.close()
            raise ZygoteUnavailable(f"the warm interpreter did not start the process: {exc}") from None
        return _ZygoteHandle(conn, pid, rest, self.zygote_pid)
