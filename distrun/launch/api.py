"""The launcher's contract: what to start (WorkerSpec) and what happened (RunResult).

Modelled on torch.distributed.elastic's agent API: a frozen spec in, a result
out, a process state machine in an Enum, and the first failing rank reported as
the root cause (not the ranks that failed because a peer vanished).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

from distrun.errors import ConfigError
from distrun.protocol import PEER_LOST, Failed, event_to_dict

__all__ = ["WorkerSpec", "ProcessState", "RunResult", "PEER_LOST"]



class ProcessState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # stopped by request (Ctrl-C, cancel) or because a peer failed
    PREEMPTED = "preempted"  # told the job would end: every rank checkpointed and stopped (exit 75)


@dataclass(frozen=True)
class WorkerSpec:
    """Processes to start on this machine, one per local rank.

    ``master_port=None`` means this launcher hosts the rendezvous: it binds a
    listening socket on an OS-chosen port and hands the open socket to global
    rank 0, so there is no probe-then-bind race for the port.
    """

    argv: tuple[str, ...]
    local_world_size: int
    world_size: int | None = None
    rank_offset: int = 0
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    cwd: str | None = None
    stop_grace_s: float = 5.0
    rank_hosts: tuple[str, ...] = ()  # the address of every global rank's host (TF_CONFIG); () = master_addr
    evaluator_hosts: tuple[str, ...] = ()  # TF_CONFIG's "evaluator" tasks
    task_type: str = "worker"  # TF_CONFIG task type of these processes: "worker" or "evaluator"
    num_ps: int = 0  # the last num_ps global ranks are ps tasks (TF_CONFIG "ps")
    #: Ranks that may fail alone (parameter-server workers other than the chief): their
    #: failure is reported but stops no one, and each is started again up to ``respawns`` times.
    independent_ranks: frozenset[int] = frozenset()
    respawns: int = 0
    #: ``--elastic``: a rank that dies without a Failed event of its own (a signal, a lost
    #: host) is a change of membership, not the job's failure: the others go on, and it is
    #: started again as a joiner while ``respawns`` last. Each launcher runs an agent
    #: process (launch/_agent); the rendezvous host's agent holds the store, so it outlives
    #: every rank.
    elastic: bool = False
    #: ``--elastic``: these ranks join a job already training (a lost host that is back).
    join: bool = False
    #: torchrun's contract: the job's id, and which restart of it this is (TORCHELASTIC_*).
    run_id: str = "local"
    restart_count: int = 0
    max_restarts: int = 0
    #: The job's data-plane secret (hex, ``protocol/secret``): every host's launcher of one job
    #: holds the same. Empty: this launcher draws one (a job on this machine alone).
    job_secret: str = field(default="", repr=False)
    #: Where ranks write their Flight Recorder dumps (``--hang-timeout-s``, ``distrun stacks``,
    #: NCCL's own dump on a timeout); None: nowhere (dumps are not asked for).
    debug_dir: str | None = None
    #: A job of this machine alone: its processes share a network namespace of their own, whose
    #: loopback no other process reaches (``launch/_netns``); where that cannot be, the machine's
    #: loopback, said in one line. Ignored on a cluster (its ranks talk across hosts).
    private_network: bool = False

    def __post_init__(self) -> None:
        if self.local_world_size < 1:
            raise ConfigError(f"local_world_size must be >= 1. Received: {self.local_world_size}")
        if self.world_size is not None and self.rank_offset + self.local_world_size > self.world_size:
            raise ConfigError(
                f"ranks {self.rank_offset}..{self.rank_offset + self.local_world_size - 1} "
                f"exceed world_size {self.world_size}"
            )
        if not self.argv:
            raise ConfigError("argv must name the program to start")

    @property
    def effective_world_size(self) -> int:
        return self.world_size if self.world_size is not None else self.local_world_size


@dataclass(frozen=True)
class RunResult:
    state: ProcessState
    returncodes: Mapping[int, int]
    failure: Failed | None = None

    @property
    def lost(self) -> tuple[int, ...]:
        """Ranks a run that succeeded went on without (``--elastic``, parameter-server workers):
        each was lost past its respawns, so its last process did not end with 0."""
        if self.state is not ProcessState.SUCCEEDED:
            return ()
        return tuple(sorted(rank for rank, code in self.returncodes.items() if code != 0))

    def record(self, *, warm: bool, reason: str | None) -> dict[str, Any]:
        """The run as a worker server keeps a job's result (``result.json``, ``distrun jobs``);
        ``reason``: why it was stopped, kept only when it was."""
        return {"state": self.state.value, "failure": event_to_dict(self.failure) if self.failure else None,
                "returncodes": {str(rank): code for rank, code in self.returncodes.items()}, "warm": warm,
                "reason": reason if self.state is ProcessState.STOPPED else None, "lost_ranks": list(self.lost)}
