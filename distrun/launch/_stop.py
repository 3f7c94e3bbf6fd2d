"""One decision to stop a job, taken before any rank is killed.

A job on several hosts is stopped host by host, so without this a rank whose host
is told late sees its peer on an earlier host vanish, raises a gloo error, and
its host records the job as ``failed``: the state a user reads after ``distrun
cancel`` would depend on which host answered first. So a stop has two phases.
The client first tells every host that the job is *stopping* (``decide``); only
then does it ask each to kill its ranks (``request``). A rank that dies after the
decision is part of the stop, not a failure; a failure the rank raised *before*
it (its ``Failed.time``, stamped on the same host's clock) is still the job's.

A decision with no kill behind it (the client died between the two phases) kills
anyway once ``kill_after_s`` has passed, so a stopping job cannot run on forever.
"""

from __future__ import annotations

import threading
import time

from distrun.protocol import Failed
from distrun.protocol.root_cause import root_cause

__all__ = ["StopDecision", "DEFAULT_KILL_AFTER_S"]

#: How long a decided stop waits for its kill request before it kills on its own: well past the
#: longest a client's phase waits for its slowest host (``client/_stop.PHASE_S``).
DEFAULT_KILL_AFTER_S = 30.0


class StopDecision:
    """Thread-safe: ``decide``/``request`` come from any thread (a server's request, a
    signal handler's thread), the launcher's supervising loop reads the rest."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._decided_at: float | None = None  # wall clock: comparable with a rank's Failed.time
        self._kill_at: float | None = None  # monotonic: when the ranks are killed
        self._killing = threading.Event()

    def decide(self, reason: str, *, kill_after_s: float = DEFAULT_KILL_AFTER_S) -> None:
        """The job is stopping: from now on a rank's death is part of the stop. The first reason wins."""
        with self._lock:
            if self._decided_at is None:
                self._reason = reason
                self._decided_at = time.time()
                self._kill_at = time.monotonic() + kill_after_s

    def request(self, reason: str) -> None:
        """Kill the ranks now (deciding first, if nobody did)."""
        self.decide(reason, kill_after_s=0.0)
        self._killing.set()

    @property
    def decided(self) -> bool:
        return self._decided_at is not None

    @property
    def reason(self) -> str | None:
        return self._reason

    def kill_due(self) -> bool:
        """The ranks must be killed now: asked to, or the decision's wait for that ran out."""
        if self._killing.is_set():
            return True
        kill_at = self._kill_at
        return kill_at is not None and time.monotonic() >= kill_at

    def part_of_stop(self, failure: Failed) -> bool:
        """``failure`` came after the decision: the stop caused it (a peer was killed first)."""
        decided_at = self._decided_at
        return decided_at is not None and failure.time >= decided_at

    def own(self, failures: list[Failed]) -> list[Failed]:
        """Failures of the job's own: not those of ranks that died after the stop was decided."""
        return [failure for failure in failures if not self.part_of_stop(failure)]

    def root_cause(self, failures: list[Failed]) -> Failed | None:
        """The failure to blame among the job's own, by the rule every place that names a failed
        job uses (``protocol/root_cause``): one host here, so any one label does."""
        blamed = root_cause(("", failure) for failure in self.own(failures))
        return blamed[1] if blamed is not None else None
