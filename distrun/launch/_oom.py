"""Telling the kernel's out-of-memory killer apart from any other SIGKILL.

"Exit -9" is the question users ask most about every launcher: the kernel's OOM killer
sends SIGKILL and says nothing to the process or its parent. What it leaves is a count:
every kill is counted in the victim's memory cgroup (v1: ``oom_kill`` in
``memory.oom_control``; v2: ``oom_kill`` in ``memory.events``), and on the whole machine
(``oom_kill`` in ``/proc/vmstat``). The launcher reads a rank's counts when it starts and
again when it dies of SIGKILL that the launcher did not send: a count that rose names the
OOM killer, with the cgroup's limit and peak, and the rank's own last reported peak.

The cgroup's count is the sure sign (a kill in the rank's own cgroup). The machine's count
alone means a process somewhere on the host was killed while the rank ran: said as
"possibly". Neither readable (no /proc, a cgroup folder this user cannot read): the
SIGKILL is described as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from distrun.planner.memory import MemoryCgroup, cgroup_of, locate, oom_kill_count

__all__ = ["MemoryCgroup", "cgroup_of", "locate", "machine_oom_kills", "OomWatch"]


def machine_oom_kills() -> int | None:
    """How many processes the OOM killer killed on this machine since boot."""
    return oom_kill_count(Path("/proc/vmstat"))


@dataclass
class _Watched:
    cgroup: MemoryCgroup | None
    cgroup_kills: int | None
    machine_kills: int | None
    peak_mb: float | None = None


class OomWatch:
    """The OOM kill counts of each rank's cgroup and of the machine, from its start."""

    def __init__(self) -> None:
        self._ranks: dict[int, _Watched] = {}

    def started(self, rank: int, pid: int) -> None:
        cgroup = cgroup_of(pid)
        self._ranks[rank] = _Watched(cgroup, cgroup.oom_kills() if cgroup else None, machine_oom_kills())

    def peak(self, rank: int, peak_mb: float | None) -> None:
        """What the rank last reported as its peak memory (its Step events)."""
        watched = self._ranks.get(rank)
        if watched is not None and peak_mb is not None:
            watched.peak_mb = peak_mb

    def explain(self, rank: int) -> str | None:
        """Why ``rank``, just dead of a SIGKILL nobody here sent, died, if the OOM killer did it."""
        watched = self._ranks.get(rank)
        if watched is None:
            return None
        own = ""
        if watched.peak_mb is not None:
            own = f"; rank {rank} last reported a peak of {_size(watched.peak_mb * 2**20)}"
        cgroup = watched.cgroup
        now = cgroup.oom_kills() if cgroup is not None else None
        if cgroup is not None and now is not None and watched.cgroup_kills is not None and now > watched.cgroup_kills:
            limit, peak = cgroup.limit_bytes(), cgroup.peak_bytes()
            bound = f"allows {_size(limit)}" if limit is not None else "has no limit (the machine ran out)"
            used = f", its peak use {_size(peak)}" if peak is not None and limit is not None else ""
            return (f"killed by the kernel's out-of-memory killer (SIGKILL): its memory cgroup {cgroup.name} "
                    f"{bound}{used}{own}")
        machine = machine_oom_kills()
        if machine is not None and watched.machine_kills is not None and machine > watched.machine_kills:
            return ("killed by SIGKILL, possibly by the kernel's out-of-memory killer (it killed a process on "
                    f"this machine while the rank ran){own}")
        return None


def _size(num_bytes: float) -> str:
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.1f} GB"
    return f"{num_bytes / 2**20:.0f} MB"
