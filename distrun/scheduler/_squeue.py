"""Reading what Slurm's commands print: jobs from squeue, times, and why an allocation ended.

Pure functions over text, so each rule is tested on Slurm's own output without a
cluster; ``slurm.py`` runs the commands.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Job", "FORMAT", "parse_squeue", "seconds", "why_ended", "NEVER_STARTS", "WAITING"]

#: squeue's --format for ``parse_squeue``: id, long state, reason, node list.
FORMAT = "--format=%i|%T|%r|%N"
#: States of a job that may still start.
WAITING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "RESIZING"})
#: Pending reasons that waiting never clears: the request itself exceeds what the partition,
#: QOS or account allows, or names what does not exist. `up` says so in one line and withdraws
#: the request. (A hold, a down partition, a reservation can clear: `up` waits, showing why.)
NEVER_STARTS = frozenset({
    "PartitionTimeLimit", "PartitionNodeLimit", "PartitionConfig", "BadConstraints", "InvalidAccount",
    "InvalidQOS", "DependencyNeverSatisfied", "QOSMaxNodePerJobLimit", "QOSMaxWallDurationPerJobLimit",
    "QOSMaxCpuPerJobLimit", "QOSMaxGRESPerJob", "AssocMaxNodesPerJobLimit", "AssocMaxWallDurationPerJobLimit",
    "AssocMaxCpuPerJobLimit", "AccountNotAllowed", "QOSNotAllowed",
})


@dataclass(frozen=True)
class Job:
    job_id: str
    state: str
    reason: str
    nodelist: str


def parse_squeue(out: str) -> list[Job]:
    """Jobs from squeue printed with ``FORMAT``; lines that are not (warnings) are skipped."""
    jobs = []
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0]:
            jobs.append(Job(*parts))
    return jobs


def seconds(text: str) -> int | None:
    """Slurm's ``[D-]HH:MM:SS`` (or ``MM:SS``) in seconds; None for UNLIMITED or anything else."""
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not all(part.isdigit() for part in parts) or not 2 <= len(parts) <= 3 or (days and not days.isdigit()):
        return None
    total = 0
    for part in parts:
        total = total * 60 + int(part)
    return total + int(days or 0) * 86400


def why_ended(job: Job, *, scontrol: str, nodes_down: str) -> str:
    """The cause of an allocation's end in one phrase.

    ``scontrol``: ``scontrol show job`` of it; ``nodes_down``: ``sinfo --list-reasons`` of its
    nodes (``n2: Not responding``). While Slurm still ends the job's processes (COMPLETING, for
    as long as KillWait) it shows no cause, so the cause is read from what else it says: the
    run time against the limit, the nodes' own state.
    """
    failed = "; ".join(line.strip() for line in nodes_down.splitlines() if line.strip())
    if job.state != "COMPLETING":
        why = "" if job.reason in ("", "None") else f", reason {job.reason}"
        return f"{job.state}{why}" + (f" (nodes down: {failed})" if failed and job.state == "NODE_FAIL" else "")
    fields = dict(item.split("=", 1) for item in scontrol.split() if "=" in item)
    ran_s, limit_s = seconds(fields.get("RunTime", "")), seconds(fields.get("TimeLimit", ""))
    if ran_s is not None and limit_s is not None and ran_s >= limit_s:
        return f"TIMEOUT (ran {fields['RunTime']} of its {fields['TimeLimit']} limit)"
    if failed:
        return f"NODE_FAIL (nodes down: {failed})"
    return "CANCELLED (scancel, or its batch script ended; no time limit reached, no node down)"
