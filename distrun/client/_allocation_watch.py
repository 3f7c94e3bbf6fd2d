"""Noticing that the hosts themselves ended: a Slurm allocation cancelled, out of time, a node failed.

When an allocation ends, Slurm kills every step on it: the worker servers, the
relays, the ranks. Seen from the client that is only streams closing, or ranks
killed by SIGTERM, none of which says why. This asks the scheduler once a
second while a job runs, so the job ends with the allocation, its nodes and
Slurm's reason in one line, within seconds of the end.

A look that raises is no verdict (a dropped login connection, a busy slurmctld), so
the watch goes on; but a look that keeps raising is a watch that sees nothing, and
saying nothing would leave the user believing the allocation is watched. So the first
failure is reported, and after ``GIVE_UP_AFTER`` in a row the watch says so and stops:
the job goes on, an allocation's end then shows only as lost hosts (and the last look
``check`` makes as the job ends).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from distrun.config import ClusterSpec
from distrun.scheduler import scheduler_for

#: How often the scheduler is asked while a job runs.
WATCH_INTERVAL_S = 1.0
#: Failed looks in a row after which the watch stops: about half a minute of asking in vain.
GIVE_UP_AFTER = 30


class AllocationWatch:
    """Calls ``on_end(reason)`` once if the cluster's hosts end before ``stop()``; ``report(line)``
    tells of the first failed look and of giving up (the job shows the line)."""

    def __init__(self, cluster: ClusterSpec, on_end: Callable[[str], None], *, report: Callable[[str], None]) -> None:
        self._scheduler = scheduler_for(cluster)
        self._on_end = on_end
        self._report = report
        self._failed_looks = 0  # in all: only the first is reported
        self._failed_in_a_row = 0
        self._stop = threading.Event()
        self.reason: str | None = None
        self._thread = threading.Thread(target=self._watch, name="allocation-watch", daemon=True)

    def start(self) -> AllocationWatch:
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                reason = self._scheduler.ended()
            except Exception as exc:  # noqa: BLE001 - a failed look (paramiko, a busy slurmctld) is no verdict
                self._look_failed(exc)
                if self._failed_in_a_row >= GIVE_UP_AFTER:
                    self._report(f"stopped watching the allocation after {self._failed_in_a_row} failed looks in a "
                                 f"row ({_one_line(exc)}); the job goes on, but if the allocation ends, only its "
                                 "lost hosts will show it")
                    return
                continue
            self._failed_in_a_row = 0
            if reason is not None:
                self.reason = reason
                self._on_end(reason)
                return

    def check(self) -> str | None:
        """Ask now (the job just lost its hosts; call after ``stop()``); the reason is kept as if
        the watch had seen it."""
        try:
            if self.reason is None:
                self.reason = self._scheduler.ended()
        except Exception as exc:  # noqa: BLE001 - as in the watch: no verdict
            self._look_failed(exc)
        finally:
            self._scheduler.close()
        return self.reason

    def _look_failed(self, exc: Exception) -> None:
        self._failed_looks += 1
        self._failed_in_a_row += 1
        if self._failed_looks == 1:
            self._report(f"could not ask whether the allocation still runs ({_one_line(exc)}); later failures "
                         "are not shown")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15.0)  # a look in flight ends within squeue's timeout
        self._scheduler.close()


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception on one line, cut at ``limit`` characters (paramiko's and ssh's run long)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text[:limit] + "..." if len(text) > limit else text
