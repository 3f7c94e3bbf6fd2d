"""The event feed a job hands to its caller: a queue in, snapshots and events out.

Local and cluster jobs produce events on background threads (the launcher, one
follower per host); the caller's thread drains them through ``events()``, which
folds each into the tracker and remembers every rank's last stderr lines for
the error that may follow.
"""

from __future__ import annotations

import dataclasses
import queue
import re
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from distrun.client._tracker import JobTracker
from distrun.protocol import HEARTBEAT_INTERVAL_S, Event, Hung, JobSnapshot, JobSummary, Output

#: How many of a rank's last stderr lines a failure shows.
STDERR_TAIL_LINES = 5
_END = object()

#: torch's c10d logs this on every rank whose host has no reverse DNS for a peer's address
#: (err=-3 is EAI_AGAIN: namespaces, containers, bare IPs). It is harmless: only a log line
#: loses a hostname. One note replaces them all, instead of one warning per rank per host.
_NO_REVERSE_DNS = "The hostname of the client socket cannot be retrieved"
_NO_REVERSE_DNS_NOTE = ("[distrun] no reverse DNS for the peers' addresses here, so c10d cannot name them in its "
                        "logs (\"hostname of the client socket cannot be retrieved\"); harmless, said once")

#: ``--profile``: what torch's profiler prints on every rank as it starts and stops (Kineto's
#: "USDT: ... profiler_start", and c10's note that memory allocated before the window has no
#: free event in the trace). Neither says anything the profile line does not; the feed drops them.
_PROFILER_NOISE = re.compile(r"SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)$"
                             r"|allocated before the profiling started, profiler results will not include")


class EventFeed:
    def __init__(self, tracker: JobTracker, *, hang_timeout_s: float | None = None,
                 on_hang: Callable[[Hung], None] | None = None, own_network: bool = False) -> None:
        """``hang_timeout_s``: yield a Hung event when no rank has stepped for this long;
        ``on_hang`` is told of it too (``--elastic`` kills the stuck rank as lost). ``own_network``:
        the job runs in a network of its own (``launch/_netns``), which has no DNS by design, so
        c10d's reverse-DNS warning says nothing worth a note there, and is dropped."""
        self.tracker = tracker
        self.hang_timeout_s = hang_timeout_s
        self._on_hang = on_hang
        self._queue: queue.Queue[Any] = queue.Queue()
        self._stderr: dict[int, deque[str]] = {}
        self._said_no_dns = own_network  # its note, once (never in a network of the job's own)

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
            if isinstance(item, Output) and _PROFILER_NOISE.search(item.line):
                continue
            if isinstance(item, Output) and _NO_REVERSE_DNS in item.line:
                if self._said_no_dns:
                    continue
                self._said_no_dns = True
                item = dataclasses.replace(item, line=_NO_REVERSE_DNS_NOTE)
            self.tracker.update(item)
            if isinstance(item, Output) and item.stream == "stderr":
                self._stderr.setdefault(item.rank, deque(maxlen=STDERR_TAIL_LINES)).append(item.line)
            yield item
            yield from self.tracker.take_made()  # a straggler named from the figures just folded in

    def stderr_tail(self, rank: int | None) -> tuple[str, ...]:
        return tuple(self._stderr.get(rank, ())) if rank is not None else ()

    def snapshot(self) -> JobSnapshot:
        return self.tracker.snapshot()

    def summary(self, status: str, error: str | None = None) -> JobSummary:
        return self.tracker.summary(status, error)
