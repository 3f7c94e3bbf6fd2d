"""This machine as a host, without SSH: the embedded default cluster uses it."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

from distrun.errors import HostError
from distrun.links._command_stream import CommandStream
from distrun.links.api import RawResult, Result, command_line
from distrun.protocol.wire import Stream


class LocalConnection:
    """Commands run with ``cwd`` = home, as an SSH login would; paths resolve the same way."""

    def __init__(self, label: str = "localhost") -> None:
        self.label = label
        self._home = Path.home()

    def run(self, argv: Sequence[str], *, stdin: str | None = None, timeout_s: float = 60.0) -> Result:
        return self.run_raw(argv, stdin=stdin.encode() if stdin is not None else None, timeout_s=timeout_s).text()

    def run_raw(self, argv: Sequence[str], *, stdin: bytes | None = None, timeout_s: float = 60.0) -> RawResult:
        line = command_line(argv)
        try:
            proc = subprocess.run(list(argv), input=stdin or b"", capture_output=True, timeout=timeout_s,
                                  cwd=self._home)
        except FileNotFoundError:
            return RawResult(line, 127, b"", f"{argv[0]}: command not found".encode())
        except subprocess.TimeoutExpired:
            raise HostError(self.label, f"`{line[:80]}` did not finish within {timeout_s:g} s") from None
        return RawResult(line, proc.returncode, proc.stdout, proc.stderr)

    def open_command(self, argv: Sequence[str]) -> Stream:
        try:
            return CommandStream(argv, label=self.label, cwd=str(self._home))
        except OSError as exc:
            raise HostError(self.label, f"cannot run {argv[0]}: {exc.strerror or exc}") from None

    def read_file(self, path: str) -> str | None:
        try:
            return (self._home / path).read_text()
        except FileNotFoundError:
            return None

    def read_bytes(self, path: str) -> bytes:
        try:
            return (self._home / path).read_bytes()
        except OSError as exc:
            raise HostError(self.label, f"cannot read {path}: {exc.strerror or exc}") from None

    def write_file(self, path: str, data: bytes) -> None:
        target = self._home / path
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, target)

    def open_stream(self, port: int) -> Stream:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=10.0)
        except OSError as exc:
            raise HostError(self.label, f"no worker server answers on 127.0.0.1:{port} ({exc.strerror or exc})") from None

    def close(self) -> None:
        pass

    def __enter__(self) -> LocalConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
