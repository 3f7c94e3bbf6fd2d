"""Tracker calls on a thread of their own, in order, never raising into training.

A tracking server that is slow (an HTTP round trip per call; MLflow retries a refused
connection for minutes) must not slow a step, and one that fails must not stop training:
the calls queue here, one thread makes them, and the first failure of each tracker is
reported once on stderr (the launcher shows rank 0's stderr), the rest are counted.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["TrackerCalls", "note", "one_line"]


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, cut at ``limit`` characters (MLflow's run to pages)."""
    text = " ".join(str(exc).split())
    return (text[:limit] + "...") if len(text) > limit else (text or type(exc).__name__)


def note(line: str) -> None:
    """One line on rank 0's stderr, where the live view and ``distrun logs`` show it."""
    print(f"[distrun] {line}", file=sys.stderr, flush=True)


class TrackerCalls:
    """A queue of calls and the one daemon thread that makes them."""

    def __init__(self, report: Callable[[str], None] = note) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._report = report
        self._failed: dict[str, int] = {}  # tracker -> failed calls so far
        self._thread = threading.Thread(target=self._run, name="distrun-trackers", daemon=True)
        self._thread.start()

    def submit(self, tracker: str, what: str, call: Callable[..., Any], *args: Any) -> None:
        """Queue ``call(*args)``; ``what`` names it in a failure report ("log_metrics")."""
        self._queue.put((tracker, what, call, args))

    def drain(self, timeout_s: float) -> bool:
        """Wait until every call queued so far has been made (True), or ``timeout_s`` (False)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def failures(self, tracker: str) -> int:
        return self._failed.get(tracker, 0)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            tracker, what, call, args = item
            try:
                call(*args)
            except BaseException as exc:  # noqa: BLE001 - a tracker's failure never reaches training
                self._failed[tracker] = self._failed.get(tracker, 0) + 1
                if self._failed[tracker] == 1:
                    self._report(f"--tracker {tracker}: {what} failed ({type(exc).__name__}: {one_line(exc)}); "
                                 f"training goes on, later failures of {tracker} are not shown")
