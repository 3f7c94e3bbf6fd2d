"""Tracker calls on a thread of their own, in order, never raising into training.

A tracking server that is slow (an HTTP round trip per call; MLflow retries a refused
connection for minutes) must not slow a step, and one that fails must not stop training:
the calls queue here, one thread makes them, and the first failure of each tracker is
reported once on stderr (the launcher shows rank 0's stderr), the rest are counted.
"""

from __future__ import annotations

import queue
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["TrackerCalls", "note", "one_line", "redact", "MAX_PENDING_CALLS"]

#: Calls a tracker may fall behind by before per-step metrics are dropped (a slow server must
#: not grow rank 0's memory without bound); the parameters, summary, checkpoint and end are kept.
MAX_PENDING_CALLS = 10_000
_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")


def redact(text: str) -> str:
    """A URI's user and password (``http://user:token@host``) never reach a log line."""
    return _CREDENTIALS.sub("***@", text)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, cut at ``limit`` characters (MLflow's run to pages)."""
    text = redact(" ".join(str(exc).split()))
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
        self._dropped: dict[str, int] = {}  # tracker -> metrics calls dropped while it was behind
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="distrun-trackers", daemon=True)
        self._thread.start()

    def submit(self, tracker: str, what: str, call: Callable[..., Any], *args: Any, droppable: bool = False) -> None:
        """Queue ``call(*args)``; ``what`` names it in a failure report ("log_metrics"). A
        ``droppable`` call is dropped (and counted) while the thread is MAX_PENDING_CALLS behind."""
        with self._lock:
            if droppable and self._pending >= MAX_PENDING_CALLS:
                self._dropped[tracker] = self._dropped.get(tracker, 0) + 1
                if self._dropped[tracker] == 1:
                    self._report(f"--tracker {tracker}: {MAX_PENDING_CALLS} calls behind; per-step metrics are "
                                 "dropped until it catches up")
                return
            self._pending += 1
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
            finally:
                with self._lock:
                    self._pending -= 1
