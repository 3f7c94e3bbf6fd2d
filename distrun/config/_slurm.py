"""The ``slurm:`` section of a cluster file, and the allocation a Slurm cluster runs on.

A Slurm cluster file lists no hosts: its nodes are whatever allocation Slurm
grants (``distrun up`` asks for one) or the allocation the client already runs
in (``SLURM_JOB_ID``). Every value here reaches ``sbatch`` as one argv element,
never through a shell, and is also held to the characters Slurm itself accepts,
so a value such as ``gpu --wrap=...`` is refused with its key before any command.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from distrun.config._hosts import HostSpec

__all__ = ["SlurmSpec", "Allocation", "SLURM_KEYS", "TIME_PATTERN", "NAME_PATTERN", "EXTRA_ARG_PATTERN",
           "REFUSED_EXTRA_ARGS"]

SLURM_KEYS = ("nodes", "partition", "time", "gpus_per_node", "cpus_per_task", "account", "qos", "constraint",
              "extra_args", "login", "grace_s")

#: sbatch's --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or UNLIMITED.
TIME_PATTERN = re.compile(r"^(?:\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(?::\d{1,2}(?::\d{1,2})?)?|UNLIMITED)$")
#: Partition, account and QOS names as Slurm allows them.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
#: A constraint expression: features joined by & | , and brackets (``a100&ib``).
CONSTRAINT_PATTERN = re.compile(r"^[A-Za-z0-9_.&|,*\[\]():-]{1,200}$")
#: One sbatch option per element, ``--name`` or ``--name=value``.
EXTRA_ARG_PATTERN = re.compile(r"^--[a-z][a-z0-9-]*(?:=[^\x00\n\r]*)?$")
#: Options distrun sets itself (or that would make the request something else).
REFUSED_EXTRA_ARGS = frozenset({"--wrap", "--job-name", "-J", "--nodes", "--parsable", "--output", "--error",
                                "--array", "--wait", "--dependency", "--test-only", "--chdir", "--export"})


@dataclass(frozen=True)
class SlurmSpec:
    """What to ask Slurm for. ``login``: run Slurm's commands on that host over SSH (a ``HostSpec``)."""

    nodes: int
    python: str = "python3"  # the nodes' interpreter (the file's top-level `python:`)
    partition: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    extra_args: tuple[str, ...] = ()
    login: HostSpec | None = None
    #: Slurm warns the allocation's steps this long before its time limit (SIGUSR1): a running
    #: job with a checkpoint folder writes a checkpoint and stops.
    grace_s: int = 120

    def sbatch_args(self) -> list[str]:
        """The request as sbatch options (argv elements), one task per node."""
        args = [f"--nodes={self.nodes}", "--ntasks-per-node=1"]
        for flag, value in (("--partition", self.partition), ("--time", self.time), ("--account", self.account),
                            ("--qos", self.qos), ("--constraint", self.constraint),
                            ("--gpus-per-node", self.gpus_per_node), ("--cpus-per-task", self.cpus_per_task)):
            if value is not None:
                args.append(f"{flag}={value}")
        return [*args, *self.extra_args]


@dataclass(frozen=True)
class Allocation:
    """A running Slurm job whose nodes are the cluster's hosts.

    ``owned``: distrun asked for it, so ``down`` ends it; the user's own allocation
    (``SLURM_JOB_ID``: an sbatch script, a salloc shell) is left alone.
    """

    job_id: str
    nodes: tuple[str, ...]
    owned: bool
