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

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryCgroup", "cgroup_of", "locate", "machine_oom_kills", "OomWatch"]

#: v1 reports "no limit" as a page-rounded 2**63 - 1.
_NO_LIMIT_BYTES = 2**62
_COUNT = re.compile(rb"^oom_kill (\d+)$", re.MULTILINE)


@dataclass(frozen=True)
class MemoryCgroup:
    """A process's memory cgroup: its folder, and which cgroup version it is."""

    folder: Path
    name: str  # as /proc/<pid>/cgroup says it: "/job/rank1"
    version: int

    def oom_kills(self) -> int | None:
        """How many processes the OOM killer killed in this cgroup (v2: and below it)."""
        return _count(self.folder / ("memory.oom_control" if self.version == 1 else "memory.events"))

    def limit_bytes(self) -> int | None:
        """The tightest limit on this cgroup and its ancestors; None: no limit."""
        if self.version == 1:  # memory.stat's hierarchical_memory_limit already takes the ancestors' into account
            stat = _read(self.folder / "memory.stat") or b""
            found = re.search(rb"^hierarchical_memory_limit (\d+)$", stat, re.MULTILINE)
            value = int(found.group(1)) if found else _int(self.folder / "memory.limit_in_bytes")
            return value if value is not None and value < _NO_LIMIT_BYTES else None
        limits, folder = [], self.folder
        while (folder / "memory.max").is_file():
            value = _int(folder / "memory.max")  # "max": None
            if value is not None:
                limits.append(value)
            folder = folder.parent
        return min(limits) if limits else None

    def peak_bytes(self) -> int | None:
        """The cgroup's peak use (v2's memory.peak needs Linux 5.19)."""
        return _int(self.folder / ("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"))


def cgroup_of(pid: int) -> MemoryCgroup | None:
    """``pid``'s memory cgroup: the v1 memory controller's, else the v2 unified one; None when
    /proc or the cgroup file system cannot tell."""
    membership = _read(Path(f"/proc/{pid}/cgroup"))
    mounts = _read(Path("/proc/self/mountinfo"))
    if membership is None or mounts is None:
        return None
    return locate(membership.decode(errors="replace"), mounts.decode(errors="replace"))


def locate(membership: str, mounts: str) -> MemoryCgroup | None:
    """The memory cgroup a ``/proc/<pid>/cgroup`` text names, found through ``/proc/self/mountinfo``'s
    text: v1's memory controller where it is mounted (a hybrid host has both), else v2's."""
    v1 = v2 = None
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1 = parts[2]
        elif parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
    for line in mounts.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        root, point = fields[3], fields[4]
        kind, _, options = line.split(" - ", 1)[1].partition(" ")
        if v1 is not None and kind == "cgroup" and "memory" in options.split()[-1].split(","):
            return _under(point, root, v1, 1)
        if v1 is None and v2 is not None and kind == "cgroup2":
            return _under(point, root, v2, 2)
    return None


def machine_oom_kills() -> int | None:
    """How many processes the OOM killer killed on this machine since boot."""
    return _count(Path("/proc/vmstat"))


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


def _under(point: str, root: str, name: str, version: int) -> MemoryCgroup | None:
    """The folder of cgroup ``name`` in a hierarchy mounted at ``point`` from its ``root``."""
    if root != "/" and not (name == root or name.startswith(root.rstrip("/") + "/")):
        return None  # a cgroup outside what this mount shows (another namespace's)
    relative = name[len(root):] if root != "/" else name
    folder = Path(point) / relative.lstrip("/")
    return MemoryCgroup(folder, name, version) if folder.is_dir() else None


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _count(path: Path) -> int | None:
    text = _read(path)
    found = _COUNT.search(text) if text is not None else None
    return int(found.group(1)) if found else None


def _size(num_bytes: float) -> str:
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.1f} GB"
    return f"{num_bytes / 2**20:.0f} MB"
