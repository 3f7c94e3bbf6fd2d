"""The event feed a job hands to its caller: a queue in, snapshots and events out.

Local and cluster jobs produce events on background threads (the launcher, one
follower per host); the caller's thread drains them through ``events()``, which
folds each into the tracker and remembers every rank's last stderr lines for
the error that may follow.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from distrun.client._tracker import JobTracker
from distrun.protocol import HEARTBEAT_INTERVAL_S, Event, Hung, JobSnapshot, JobSummary, Output

#: How many of a rank's last stderr lines a failure shows.
STDERR_TAIL_LINES = 5
_END = object()


class EventFeed:
    def __init__(self, tracker: JobTracker, *, hang_timeout_s: float | None = None,
                 on_hang: Callable[[Hung], None] | None = None) -> None:
        """``hang_timeout_s``: yield a Hung event when no rank has stepped for this long;
        ``on_hang`` is told of it too (``--elastic`` kills the stuck rank as lost)."""
        self.tracker = tracker
        self.hang_timeout_s = hang_timeout_s
        self._on_hang = on_hang
        self._queue: queue.Queue[Any] = queue.Queue()
        self._stderr: dict[int, deque[str]] = {}

    def put(self, event: Event) -> None:
        """Thread-safe: called by the producers."""
        self._queue.put(event)

    def end(self) -> None:
        self._queue.put(_END)

    def events(self, poll_s: float = 0.25) -> Iterator[Event | None]:
        """Yield events as they come; ``None`` every ``poll_s`` without one (for redraws)."""
        while True:
            if self.hang_timeout_s is not None:
                hang = self.tracker.check_hang(self.hang_timeout_s, HEARTBEAT_INTERVAL_S)
                if hang is not None:
                    self.tracker.update(hang)
                    if self._on_hang is not None:
                        self._on_hang(hang)
                    yield hang
            try:
                item = self._queue.get(timeout=poll_s)
            except queue.Empty:
                yield None
                continue
            if item is _END:
                return
            self.tracker.update(item)
            if isinstance(item, Output) and item.stream == "stderr":
                self._stderr.setdefault(item.rank, deque(maxlen=STDERR_TAIL_LINES)).append(item.line)
            yield item

    def stderr_tail(self, rank: int | None) -> tuple[str, ...]:
        return tuple(self._stderr.get(rank, ())) if rank is not None else ()

    def snapshot(self) -> JobSnapshot:
        return self.tracker.snapshot()

    def summary(self, status: str, error: str | None = None) -> JobSummary:
        return self.tracker.summary(status, error)
