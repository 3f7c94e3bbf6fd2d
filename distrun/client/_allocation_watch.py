"""Noticing that the hosts themselves ended: a Slurm allocation cancelled, out of time, a node failed.

When an allocation ends, Slurm kills every step on it: the worker servers, the
relays, the ranks. Seen from the client that is only streams closing, or ranks
killed by SIGTERM, none of which says why. This asks the scheduler once a
second while a job runs, so the job ends with the allocation, its nodes and
Slurm's reason in one line, within seconds of the end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from distrun.config import ClusterSpec
from distrun.scheduler import scheduler_for

#: How often the scheduler is asked while a job runs.
WATCH_INTERVAL_S = 1.0


class AllocationWatch:
    """Calls ``on_end(reason)`` once if the cluster's hosts end before ``stop()``."""

    def __init__(self, cluster: ClusterSpec, on_end: Callable[[str], None]) -> None:
        self._scheduler = scheduler_for(cluster)
        self._on_end = on_end
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
            except Exception:  # noqa: BLE001 - a failed look (paramiko, a busy slurmctld) is no verdict
                continue
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
        except Exception:  # noqa: BLE001 - as in the watch: no verdict
            pass
        finally:
            self._scheduler.close()
        return self.reason

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15.0)  # a look in flight ends within squeue's timeout
        self._scheduler.close()
