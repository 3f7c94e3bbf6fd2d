"""A server's folder on its host: state file, lock, log.

The state file holds the port and the token, so it is written 0600 inside a
0700 folder, atomically (temp file, fsync, rename), and removed when the server
stops. The lock file is held (flock) for the server's whole life, so two
servers can never share one folder even if two `up` runs race.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from distrun.protocol.cluster import ServerState

STATE_FILE = "server.json"
LOCK_FILE = "server.lock"
LOG_FILE = "server.log"


class StateDir:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).absolute()

    @property
    def state_file(self) -> Path:
        return self.path / STATE_FILE

    @property
    def log_file(self) -> Path:
        return self.path / LOG_FILE

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path, 0o700)

    def lock(self) -> int | None:
        """Take the folder's lock; return the held fd, or None if another server holds it."""
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def write(self, state: ServerState) -> None:
        tmp = self.path / f".{STATE_FILE}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, state.to_json().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.state_file)
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def read(self) -> ServerState | None:
        try:
            return ServerState.from_json(self.state_file.read_text())
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return None

    def remove_if_ours(self, pid: int) -> None:
        state = self.read()
        if state is not None and state.pid == pid:
            with contextlib.suppress(FileNotFoundError):
                self.state_file.unlink()
