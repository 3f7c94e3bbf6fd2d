"""A command's stdin and stdout as one byte stream, with its failure named at the end.

``srun`` relays a node's worker server over its stdin and stdout; this is the
client's end. On this machine the command's stdin and stdout are one end of a
socket pair, so the stream is a real socket (timeouts, partial reads) and the
wire code needs nothing new. When the output ends and the command failed,
``recv`` raises ``ConnectionError`` with its last line of stderr ("Invalid job
id specified", "no worker server on port ...") instead of a bare EOF.
"""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Sequence

from distrun.links.api import last_line

#: stderr kept for the message; a relay that talks more than this is not reporting an error.
_STDERR_KEPT_BYTES = 8192
#: How long ``close`` waits for the command to end on its own once its stdin is closed.
_EXIT_WAIT_S = 5.0


class CommandStream:
    """``argv`` started with a socket as stdin and stdout; the other end is ours."""

    def __init__(self, argv: Sequence[str], *, label: str, cwd: str | None = None) -> None:
        ours, theirs = socket.socketpair()
        self._label = label
        self._sock = ours
        self._stderr = bytearray()
        try:
            self._proc = subprocess.Popen(list(argv), stdin=theirs, stdout=theirs, stderr=subprocess.PIPE,
                                          cwd=cwd, start_new_session=True)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        for chunk in iter(lambda: self._proc.stderr.read1(4096), b""):  # type: ignore[union-attr]
            if len(self._stderr) < _STDERR_KEPT_BYTES:
                self._stderr += chunk[: _STDERR_KEPT_BYTES - len(self._stderr)]

    def sendall(self, data: bytes, /) -> None:
        self._sock.sendall(data)

    def recv(self, size: int, /) -> bytes:
        data = self._sock.recv(size)
        if not data:
            self._raise_if_failed()
        return data

    def _raise_if_failed(self) -> None:
        try:
            code = self._proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return
        self._reader.join(1.0)
        if code != 0:
            raise ConnectionError(last_line(bytes(self._stderr)) or f"{self._label}: exit code {code}")

    def settimeout(self, timeout: float | None, /) -> None:
        self._sock.settimeout(timeout)

    def close(self) -> None:
        self._sock.close()  # the command reads EOF on stdin and ends
        try:
            self._proc.wait(timeout=_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self._proc.terminate()  # srun ends its step on SIGTERM; a SIGKILLed srun cannot
            try:
                self._proc.wait(timeout=_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(1.0)
        if self._proc.stderr is not None and not self._reader.is_alive():
            self._proc.stderr.close()

