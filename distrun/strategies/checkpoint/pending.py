"""A checkpoint being written in the background (``--async-checkpoint``).

DCP's ``async_save`` copies the shards out of the model (the only part a step waits for),
then writes them on a thread of its own; its future resolves once every rank's file and the
index are written. Rank 0 must then publish the checkpoint (``shards.commit``: sidecar and
rename). That runs here, on one more thread, right after the write, rather than in a
done-callback: ``Future.result()`` returns before callbacks finish, so a caller could not
tell a published checkpoint from one about to be.

Nothing here touches the training's process group: DCP's collectives for an async save go
over a gloo group of their own (``ShardedStrategy`` makes it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from distrun.errors import DistrunError
from distrun.strategies.checkpoint.write_failure import write_failed

__all__ = ["PendingSave"]


class PendingSave:
    def __init__(self, step: int, written: Future, publish: Callable[[], Path | None], blocked_ms: float, *,
                 discard: Callable[[BaseException], None], directory: Path,
                 recorded: Callable[[], OSError | None] = lambda: None) -> None:
        """``written``: DCP's future; ``publish``: what runs once it resolves (rank 0's commit,
        nothing elsewhere); ``discard``: what runs if the write failed (every rank removes what
        was written); ``blocked_ms``: how long the step that started it waited; ``recorded``:
        the OSError a write of this rank's raised, if one did (``RecordingStreams``)."""
        self.step = step
        self.blocked_ms = blocked_ms
        self.directory = directory
        self._written = written
        self._publish = publish
        self._discard = discard
        self._recorded = recorded
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"distrun-checkpoint-{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._written.result()
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self._error = exc
            self._discard(exc)
            return
        try:
            self._path = self._publish()
        except BaseException as exc:  # noqa: BLE001 - raised again on the training thread by wait()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path | None:
        """The published path (rank 0; None elsewhere), once written; the save's error, if it failed."""
        self._thread.join()
        if isinstance(self._error, DistrunError):
            raise self._error
        if self._error is not None:
            raise write_failed(self.directory, self.step, self._error, self._recorded())
        return self._path
