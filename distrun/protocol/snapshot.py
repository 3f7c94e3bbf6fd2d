"""Immutable views of a job's progress, the input of every live table and summary.

The client folds events into these snapshots; the UI renders them as pure
functions. They are plain data so a worker server can later send them to a
client that attaches to a running job.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["ReplicaStatus", "ReplicaRow", "JobSnapshot", "JobSummary", "mesh_place", "describe_mesh"]


class ReplicaStatus(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class ReplicaRow:
    rank: int
    device: str = "?"
    pid: int | None = None
    step: int = 0
    epoch: int = 0
    loss: float | None = None
    samples_per_s: float = 0.0
    mem_mb: float = 0.0
    peak_mem_mb: float = 0.0  # the rank's peak so far (CUDA max allocated, or peak RSS)
    last_seen_s: float = 0.0
    status: ReplicaStatus = ReplicaStatus.STARTING
    host: str | None = None  # on a cluster: the host the rank runs on
    gpu_util: float | None = None  # GPU ranks with NVML: utilisation in percent
    #: parameter-server jobs: "worker" or "ps"; a worker's steps/s (its own pushes) and
    #: staleness; a ps task's updates/s, traffic and the parameters (elements) it holds.
    role: str = "worker"
    steps_per_s: float | None = None
    staleness: int | None = None
    updates: int = 0
    updates_per_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    params: int = 0
    #: compute time per step (the step's wall time less its wait for peers), as the rank last said;
    #: ``slow``: its ratio to the other ranks' median while it is named a straggler, else None.
    compute_ms: float | None = None
    slow: float | None = None


@dataclass(frozen=True)
class JobSnapshot:
    recipe: str
    strategy: str
    rows: tuple[ReplicaRow, ...]
    step: int
    total_steps: int | None
    elapsed_s: float
    eval_metrics: dict[str, float] = field(default_factory=dict)
    last_checkpoint: str | None = None
    hang: str | None = None  # set while no rank makes progress past --hang-timeout-s
    evaluator_step: int | None = None  # the evaluator's newest result: the checkpoint's step...
    evaluator_metrics: dict[str, float] = field(default_factory=dict)  # ...and its metrics
    compile_line: str | None = None  # --compile: graphs, breaks and recompilations on the chief
    membership_line: str | None = None  # --elastic: the newest change of the group
    tokens_per_s: float | None = None  # a recipe with tokens_per_sample: samples/s times it
    mfu: float | None = None  # ...and with flops_per_token, on a known GPU: model FLOPs/s over the peak
    straggler_line: str | None = None  # slow ranks named: host, rank, how much slower
    mesh: dict[str, int] | None = None  # --tp/--pp: the degrees ({"dp": 2, "tp": 2, "pp": 1}); None: one rank a replica
    #: --strategy diloco: outer steps so far and the newest sync's bytes and seconds; --embeddings ps: the
    #: bytes a step moves, table rows to and from the ps tasks and dense gradients all-reduced.
    sync_line: str | None = None
    lr: float | None = None  # the chief's newest Step event's learning rate (a fit recipe's; None: unknown)
    micro_batch: tuple[int, int] | None = None  # --accumulate: (a replica's micro-batch samples, micro-batches a step)

    @property
    def samples_per_s(self) -> float:
        return sum(r.samples_per_s for r in self.rows)

    @property
    def workers(self) -> tuple[ReplicaRow, ...]:
        return tuple(r for r in self.rows if r.role == "worker")

    @property
    def ps_tasks(self) -> tuple[ReplicaRow, ...]:
        return tuple(r for r in self.rows if r.role == "ps")

    @property
    def eta_s(self) -> float | None:
        if not self.total_steps or self.step <= 0:
            return None
        rate = self.step / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (self.total_steps - self.step) / rate if rate > 0 else None


@dataclass(frozen=True)
class JobSummary:
    """The last line of ``--json`` output and the final table."""

    status: str
    recipe: str
    strategy: str
    replicas: int
    steps: int
    final_loss: float | None
    samples_per_s: float
    time_to_first_step_s: float | None
    wall_s: float
    eval_metrics: dict[str, float] = field(default_factory=dict)
    last_checkpoint: str | None = None
    error: str | None = None
    restarts: int = 0  # cluster jobs with --max-restarts: how many times every rank was restarted
    evaluator_step: int | None = None  # cluster jobs with an evaluator host: its newest result
    evaluator_metrics: dict[str, float] = field(default_factory=dict)
    precision: str = "fp32"
    #: --compile: {"mode", "compile_s", "graphs", "graph_breaks", "recompiles"} from the chief; None without it.
    compile: dict[str, Any] | None = None
    #: --compression: what gradients were all-reduced as (none, fp16, bf16, powersgd:RANK).
    compression: str = "none"
    #: --allreduce: how gradients met across hosts (flat: DDP's ring; hierarchical); auto's choice.
    allreduce: str = "flat"
    #: --allreduce auto: why it kept that one (measured figures, or the rule that decided).
    allreduce_reason: str | None = None
    #: Every rank was forked from a warm interpreter (a server's zygote) rather than started cold.
    warm: bool = False
    #: --elastic: groups formed after the first (a replica lost or joined), the committed steps
    #: lost to them (0 where the design holds) and the longest recovery, failure to next step.
    membership_changes: int = 0
    steps_lost: int = 0
    recovery_s: float | None = None
    #: The replicas training at the end (or now): ``replicas``, or under --elastic the group's size then.
    world_size: int | None = None
    #: Ranks the job went on without, each lost past its respawns (--elastic; parameter-server workers).
    ranks_lost: list[int] = field(default_factory=list)
    #: Each rank's peak memory in MB ("rank": MB): CUDA's max allocated, or the process's peak RSS.
    peak_mem_mb: dict[str, float] = field(default_factory=dict)
    #: The longest a step waited for a checkpoint, in ms (the whole write; with
    #: --async-checkpoint, the copy out of the model). None: no checkpoint was written.
    checkpoint_blocked_ms: float | None = None
    #: A recipe with ``tokens_per_sample``: tokens/s over the run; with ``flops_per_token`` on a
    #: GPU whose peak distrun knows, MFU (model FLOPs/s over the devices' dense peak, 0-1).
    tokens_per_s: float | None = None
    mfu: float | None = None
    #: Ranks named stragglers during the run ("rank": the highest compute-time ratio seen).
    stragglers: dict[str, float] = field(default_factory=dict)
    #: ``--profile``: where the ranks' traces were written (on a cluster, each host's job folder;
    #: the results dir names where they came home), and how many were written.
    profile_dir: str | None = None
    profile_traces: int = 0
    #: A job that was stopped: why, as its hosts recorded it ("cancelled by alice from laptop"); a
    #: run a recipe's callback ended early (it succeeded): the callback and what it watched.
    reason: str | None = None
    #: ``--resume``: {"path", "step", "past_end"} of the checkpoint it went on from (past_end: at or
    #: past the job's last step already, so nothing was trained); None without --resume.
    resumed: dict[str, Any] | None = None
    #: fit, custom-loop or script (a plain torchrun script, which runs its own DDP: the strategy only
    #: set how many processes it got); None when no rank started.
    recipe_kind: str | None = None
    #: ``--tp``/``--pp``: the job's degrees, ``{"dp": R, "tp": T}`` and ``"pp": P`` when pipelined
    #: (``replicas`` is ``dp``, each of ``tp x pp`` ranks); None where a replica is one rank.
    mesh: dict[str, int] | None = None
    #: MB the training hosts sent on their interfaces (loopback excluded) while the ranks ran, summed
    #: over hosts (each host's ranks read the same counters: its largest counts once); None if unknown.
    net_mb_sent: float | None = None
    #: ``--strategy diloco``: whole-model syncs (outer steps), and over every sync the MB the chief
    #: sent and the seconds its steps waited for them; None under other strategies.
    outer_steps: int | None = None
    sync_mb: float | None = None
    sync_blocked_s: float | None = None
    #: ``--embeddings ps``: bytes a step on a replica (the mean over steps and replicas) of table rows
    #: pulled plus row gradients pushed (ps traffic, ids aside), and of dense gradients all-reduced
    #: (the dense parameters' gradients, which DDP's buckets carry); None under other strategies.
    embedding_bytes_per_step: float | None = None
    dense_grad_bytes_per_step: float | None = None
    #: ``--accumulate N``: the samples of one micro-batch on a replica (a forward and backward), and N;
    #: None and 1 without accumulation.
    micro_batch_size: int | None = None
    accumulate: int = 1
    #: ``--strategy auto``: the chosen layout (the job file's keys), its predicted peak and step time,
    #: every candidate's verdict, and the run's measured peak and step time beside them.
    plan: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"type": "summary", **dataclasses.asdict(self)}


def mesh_place(rank: int, mesh: dict[str, int]) -> dict[str, int]:
    """Rank ``rank``'s replica (``dp``) and place in it (``tp``, and ``pp`` when pipelined), tensor
    parallel innermost and pipeline stages outermost: the one layout the strategies build and
    the live view shows (strategies/parallel/mesh.py)."""
    tp, dp = mesh.get("tp", 1), mesh.get("dp", 1)
    place = {"dp": (rank // tp) % dp, "tp": rank % tp}
    if mesh.get("pp", 1) > 1:
        place["pp"] = rank // (tp * dp)
    return place


def describe_mesh(mesh: dict[str, int]) -> str:
    """``dp 2 x tp 2`` (``x pp P`` when pipelined: the JSON names every degree, the eye only those in use)."""
    return " x ".join(f"{name} {size}" for name, size in mesh.items() if name != "pp" or size > 1)
