"""Why a checkpoint could not be written, in one line: a full disk is named as one.

Neither writer says so by itself. ``torch.save`` into a file whose write raises ``ENOSPC``
drops the OSError and fails with "[enforce fail at inline_container.cc:672] unexpected pos
5184 vs 5078"; ``RecordingFile`` keeps the OSError so it can be named. DCP gathers every
rank's exception into a ``CheckpointException`` (a BaseException, not an Exception) whose
text is a traceback per rank; ``os_error_in`` finds the OSError inside.

Who cleans up stays with the writers (``files``: the temporary file; ``shards``: the
temporary folder); what the newest complete checkpoint is, ``catalog.newest_complete``.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import Any

from distrun.errors import CheckpointError

__all__ = ["RecordingFile", "RecordingStreams", "os_error_in", "write_failed"]

#: The errors that mean "no room", in the words a user searches for.
_NO_ROOM = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up"}


class RecordingFile:
    """A file object for ``torch.save`` that remembers the OSError a write raised."""

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._fh.flush()

    def __getattr__(self, name: str) -> Any:  # tell, fileno (DCP's fsync), ...: the file's own
        return getattr(self._fh, name)


class RecordingStreams:
    """DCP's file system for a writer (``FileSystemWriter.fs``), whose write streams remember the
    OSError a write raised: DCP writes each tensor with ``torch.save``, whose C++ writer turns
    ENOSPC into "unexpected pos", so its ``CheckpointException`` often holds no OSError (seen:
    about one full-disk save in four named it; the others said only "CheckpointException")."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        self.error: OSError | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._fs.create_stream(path, mode) as stream:
            recording = RecordingFile(stream)
            try:
                yield recording
            finally:
                if recording.error is not None:
                    self.error = recording.error


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and every rank's exception inside DCP's
    ``CheckpointException`` (``failures``: rank -> (exception, stack)), each once."""
    pending, seen = [exc], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending.extend(pair[0] for pair in failures.values() if isinstance(pair, tuple) and pair)
        pending.extend((current.__cause__, current.__context__))


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc``: itself, its cause or context, or any rank's inside DCP's
    ``CheckpointException``."""
    return next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno is not None), None)


def write_failed(folder: str | os.PathLike[str], step: int, exc: BaseException,
                 recorded: OSError | None = None) -> CheckpointError:
    """One line for a checkpoint write that raised ``exc`` (``recorded``: what a RecordingFile kept)."""
    cause = recorded or os_error_in(exc) or _said_in(exc)
    if cause is not None and cause.errno in _NO_ROOM:
        why = f"{_NO_ROOM[cause.errno]} ({cause.strerror or os.strerror(cause.errno)})"
    elif cause is not None:
        why = cause.strerror or str(cause)
    else:
        text = str(exc).strip().splitlines()
        why = f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
    return CheckpointError(f"{folder}: cannot write the checkpoint of step {step}: {why}")


def _said_in(exc: BaseException) -> OSError | None:
    """An errno's words anywhere in the text of ``exc`` and of what it wraps: a writer thread's
    error may reach DCP's ``CheckpointException`` as another type (a RuntimeError from torch's
    C++ writer, a pickled copy from another rank) that keeps only the words."""
    text = "\n".join(str(current) for current in _chain(exc))
    for number in _NO_ROOM:
        if os.strerror(number) in text:
            return OSError(number, os.strerror(number))
    return None
