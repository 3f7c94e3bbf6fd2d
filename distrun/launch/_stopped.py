"""``--elastic``: a rank stopped by a signal is lost, and its launcher starts it again.

A rank that gets SIGSTOP (or SIGTSTP, SIGTTIN: the kernel's state ``T``) stops its beat, and
the others go on without it within a second (``strategies/elastic/membership.LOST_AFTER_S``).
But it never runs again to find itself fenced out and rejoin, as a rank whose link came back
does; and it keeps the job from ending, since the launcher waits for it. So the launcher
reads each rank's state, and one stopped for ``STOPPED_LOST_S`` is killed as lost and comes
back as a joiner, as a hung rank does. A debugger's stop (state ``t``, tracing) is not a
stop here: someone is looking at it. Only elastic jobs: elsewhere the job cannot go on
without the rank, and ``--hang-timeout-s`` names it ("no heartbeat").
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["STOPPED_LOST_S", "StoppedWatch", "is_stopped"]

#: Five times the membership's LOST_AFTER_S: the group has long gone on without the rank by then.
STOPPED_LOST_S = 5.0
_CHECK_EVERY_S = 0.5


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (state ``T``); False if gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    after_name = stat.rsplit(b")", 1)[-1].split()  # the name (field 2) may hold spaces and ")"
    return bool(after_name) and after_name[0] == b"T"


class StoppedWatch:
    """Which ranks have been stopped for ``lost_after_s``, each process said once."""

    def __init__(self, lost_after_s: float = STOPPED_LOST_S) -> None:
        self._lost_after_s = lost_after_s
        self._since: dict[int, float] = {}  # pid -> when it was first seen stopped
        self._said: set[int] = set()
        self._next_check = 0.0

    def check(self, pids: Mapping[int, int], now: float) -> list[tuple[int, str]]:
        """(rank, why) of the ranks in ``pids`` (rank -> pid, the running ones) stopped long enough."""
        if now < self._next_check:
            return []
        if now - self._next_check > 10 * _CHECK_EVERY_S:  # we were stopped too (the whole job suspended):
            self._since.clear()  # a rank's stop began no earlier than our own resumption
        self._next_check = now + _CHECK_EVERY_S
        for pid in set(self._since) - set(pids.values()):  # gone, or started again under another pid
            del self._since[pid]
        lost = []
        for rank, pid in pids.items():
            if not is_stopped(pid):
                self._since.pop(pid, None)
                continue
            since = self._since.setdefault(pid, now)
            if now - since >= self._lost_after_s and pid not in self._said:
                self._said.add(pid)
                lost.append((rank, f"stopped by a signal for {now - since:.0f} s"))
        return lost
