"""The memory a process may use: its memory cgroup, found and read.

A rank's budget (``--strategy auto``: the client's for a local job, each host's rank's for a
cluster's probe) and the launcher's account of an OOM kill (``launch/_oom.py``) read the same
files: the cgroup a process is in (``/proc/<pid>/cgroup``, found through ``mountinfo``: v1's
memory controller where it is mounted, else v2's unified hierarchy), its tightest limit with
its ancestors', its use now and at its peak, and the OOM killer's count in it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryCgroup", "cgroup_of", "locate", "oom_kill_count", "rank_budget_bytes"]

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
        return oom_kill_count(self.folder / ("memory.oom_control" if self.version == 1 else "memory.events"))

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

    def usage_bytes(self) -> int | None:
        """What the cgroup's processes use now (page cache included, as its limit counts it)."""
        return _int(self.folder / ("memory.usage_in_bytes" if self.version == 1 else "memory.current"))


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


def oom_kill_count(path: Path) -> int | None:
    """The ``oom_kill N`` count in a cgroup's events file or /proc/vmstat; None: unreadable."""
    text = _read(path)
    found = _COUNT.search(text) if text is not None else None
    return int(found.group(1)) if found else None


def rank_budget_bytes(ranks_here: int, held_bytes: int, group: MemoryCgroup | None,
                      available_bytes: int) -> tuple[int, str]:
    """One rank's memory budget on a CPU host with ``ranks_here`` ranks, each holding about
    ``held_bytes`` now: its share of the host's ``available_bytes`` (MemAvailable) plus what it
    holds, and, where its memory cgroup has a limit, no more than its share of the cgroup's room
    (the limit less its use now) plus what it holds. Returns the bytes and where they came from."""
    ranks_here = max(1, ranks_here)
    budget, source = available_bytes // ranks_here + held_bytes, f"MemAvailable, shared by {ranks_here} rank(s)"
    limit = group.limit_bytes() if group is not None else None
    if group is not None and limit is not None:
        room = max(0, limit - (group.usage_bytes() or 0))
        if room // ranks_here + held_bytes < budget:
            budget = room // ranks_here + held_bytes
            source = f"memory cgroup {group.name}'s limit less its use, shared by {ranks_here} rank(s)"
    return budget, source
