"""The contract every host link fulfils: run a command, read a file, open a stream.

``Connection`` (SSH, paramiko), ``LocalConnection`` (this machine, no SSH) and
``SrunLink`` (a node of a Slurm allocation, through ``srun``) all satisfy
``Remote``, so the cluster code above is the same for a real cluster, a Slurm
allocation and the embedded default. Modelled on Fabric: ``run`` takes an argv
list (quoted with ``shlex`` before any shell sees it) and returns a ``Result``.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from distrun.errors import HostError
from distrun.protocol.wire import Stream

__all__ = ["Result", "RawResult", "CommandFailed", "Remote", "command_line", "last_line"]


def last_line(text: str | bytes) -> str:
    """The last non-empty line of a command's output, stripped ("" if none): a one-line error."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@dataclass(frozen=True)
class Result:
    command: str
    exited: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exited == 0

    def last_line(self) -> str:
        """The most telling line of the output for a one-line error (stderr first)."""
        return last_line(self.stderr) or last_line(self.stdout) or f"exit code {self.exited}"


@dataclass(frozen=True)
class RawResult:
    """A command's exit code and its output as bytes (a file coming home, a checkpoint)."""

    command: str
    exited: int
    stdout: bytes
    stderr: bytes

    def text(self) -> Result:
        return Result(self.command, self.exited, self.stdout.decode(errors="replace"),
                      self.stderr.decode(errors="replace"))


class CommandFailed(HostError):
    """A remote command exited non-zero; ``result`` holds what it printed."""

    def __init__(self, host: str, result: Result, what: str) -> None:
        super().__init__(host, f"{what} failed: {result.last_line()}",
                         detail=f"$ {result.command}\n{result.stdout}{result.stderr}")
        self.result = result


class Remote(Protocol):
    """A host distrun can use. ``label`` names it in every message."""

    label: str

    def run(self, argv: Sequence[str], *, stdin: str | None = None, timeout_s: float = 60.0) -> Result: ...

    def run_raw(self, argv: Sequence[str], *, stdin: bytes | None = None, timeout_s: float = 60.0) -> RawResult:
        """``run`` with bytes in and out."""
        ...

    def open_command(self, argv: Sequence[str]) -> Stream:
        """A byte stream to a command's stdin and stdout (srun's relay to a node rides on one).

        Reading past the command's output raises ``ConnectionError`` with its last line
        of stderr when it failed, so a broken relay is named, not just "closed".
        """
        ...

    def read_file(self, path: str) -> str | None:
        """The file's text, or None if it does not exist. Relative paths start at the login directory."""
        ...

    def read_bytes(self, path: str) -> bytes:
        """The whole file (a checkpoint coming home); HostError if it cannot be read."""
        ...

    def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` atomically (a temporary name, then a rename); 0600."""
        ...

    def open_stream(self, port: int) -> Stream:
        """A byte stream to ``127.0.0.1:port`` on the host."""
        ...

    def close(self) -> None: ...


def command_line(argv: Sequence[str]) -> str:
    """The one way distrun builds a remote command: every element quoted, nothing interpolated."""
    if not argv:
        raise ValueError("empty command")
    return shlex.join(argv)
