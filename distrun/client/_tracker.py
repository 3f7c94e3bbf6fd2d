"""Folding a job's event stream into immutable snapshots and a final summary."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from distrun.client._stragglers import SLOW_INTERVALS, StragglerWatch
from distrun.client._syncs import SyncTally
from distrun.config import JobSpec
from distrun.protocol import (
    EVALUATOR_RANK,
    AllReduceChosen,
    MembershipChanged,
    Synced,
    Checkpointed,
    Resumed,
    Workload,
    Compiled,
    Done,
    Eval,
    Event,
    Exited,
    Failed,
    Heartbeat,
    Hung,
    JobSnapshot,
    JobSummary,
    PsStats,
    ReplicaRow,
    ReplicaStatus,
    Profiled,
    Started,
    Step,
    Straggler,
)


def tracker_settings(spec: JobSpec) -> dict[str, Any]:
    """The step settings a summary reports, from the job's spec (JobTracker's keywords)."""
    precision = spec.precision
    return {"precision": precision.name, "compile_mode": precision.compile_mode if precision.compile else None,
            "compression": str(spec.communication.compression_spec), "allreduce": spec.communication.allreduce,
            "mesh": spec.mesh if spec.parallel.ranks_per_replica > 1 else None,
            "micro_batch": _micro_batch(spec)}


def _micro_batch(spec: JobSpec) -> tuple[int, int] | None:
    """``--accumulate N``: (a micro-batch's samples on a replica, N); None without accumulation."""
    per_replica, parts = spec.per_replica_batch_size, spec.training.accumulate
    return (per_replica // parts, parts) if per_replica is not None and parts > 1 else None


class JobTracker:
    """Mutable accumulator owned by one consumer thread; hands out frozen snapshots."""

    def __init__(self, recipe: str, strategy: str, replicas: int, started_at: float | None = None,
                 host_of_rank: Callable[[int], str] | None = None, ps_tasks: int = 0, precision: str = "fp32",
                 compile_mode: str | None = None, compression: str = "none", allreduce: str = "flat",
                 mesh: dict[str, int] | None = None, micro_batch: tuple[int, int] | None = None) -> None:
        """``replicas`` training ranks, then ``ps_tasks`` parameter-server ranks; ``compile_mode``
        is None unless the job runs with ``--compile``; ``mesh``: --tp's degrees (a replica of
        several ranks: the summary's ``replicas`` is then its ``dp``)."""
        self._mesh = dict(mesh) if mesh else None
        self._micro_batch = micro_batch  # --accumulate: (samples a replica's micro-batch, micro-batches a step)
        self._recipe = recipe
        self._strategy = strategy
        self._compression = compression
        self._allreduce = allreduce  # "auto" until the chief says what it kept
        self._allreduce_reason: str | None = None
        self._t0 = started_at if started_at is not None else time.time()
        self._replicas = replicas
        self._rows = {r: ReplicaRow(rank=r, host=host_of_rank(r) if host_of_rank else None,
                                    role="ps" if r >= replicas else "worker")
                      for r in range(replicas + ps_tasks)}
        self._rates: dict[int, tuple[float, int]] = {}  # rank -> (time, pushes or updates) of the last figure
        self._seen: dict[int, float] = {}
        #: Each rank's newest total: a training job's ranks agree on it; a predict job's replicas
        #: each have their share's batches, and the job is done at the largest.
        self._totals: dict[int, int] = {}
        self._lr: float | None = None  # the chief's newest step's learning rate (a fit recipe's)
        self._eval: dict[str, float] = {}
        self._checkpoint: str | None = None
        self._resumed: Resumed | None = None
        self._recipe_kind: str | None = None  # from the ranks' Started: a plain script's summary says so
        self._checkpoint_blocked_ms: float | None = None
        self._workload: Workload | None = None
        self._done: dict[int, Done] = {}
        self._first_step_at: float | None = None
        self._last_step_at: float | None = None
        self._where: dict[int, str] = {}
        self._beat: dict[int, float] = {}
        self._hang: Hung | None = None
        self._evaluator: tuple[int, dict[str, float]] | None = None
        self._precision = precision
        self._compile_mode = compile_mode
        self._compiled: Compiled | None = None  # the chief's newest compiler figures
        self._changes: list[MembershipChanged] = []  # --elastic: each new group
        self._syncs = SyncTally()  # --strategy diloco
        self._steps_lost = 0
        self._stragglers = StragglerWatch()
        self._straggler_events: list[Straggler] = []  # made here, not yet handed out (take_made)
        self._profiles: list[Profiled] = []  # --profile: each rank's trace

    def update(self, event: Event) -> None:
        if isinstance(event, Hung):  # made by the client; may name no rank (-1)
            self._hang = event
            return
        if event.rank == EVALUATOR_RANK and isinstance(event, Eval):
            self._evaluator = (event.step, dict(event.metrics))
            return
        if event.rank < 0:  # a note from a worker server or the evaluator, not from a rank
            return
        row = self._rows.get(event.rank) or ReplicaRow(rank=event.rank)
        self._seen[event.rank] = time.time()
        if isinstance(event, Started):
            row = dataclasses.replace(row, device=event.device, pid=event.pid, status=ReplicaStatus.RUNNING)
            self._recipe_kind = event.recipe_kind
        elif isinstance(event, Step):
            row = dataclasses.replace(
                row, step=event.step, epoch=event.epoch, loss=event.loss, samples_per_s=event.samples_per_s,
                mem_mb=event.mem_mb, gpu_util=event.gpu_util, status=ReplicaStatus.RUNNING,
                peak_mem_mb=max(row.peak_mem_mb, event.peak_mem_mb or 0.0),
            )
            if event.pushes is not None:
                row = dataclasses.replace(row, staleness=event.staleness,
                                          steps_per_s=self._rate(event.rank, event.time, event.pushes, row.steps_per_s))
            if event.total_steps is not None:
                self._totals[event.rank] = event.total_steps
            if event.rank == 0 and event.lr is not None:
                self._lr = event.lr
            self._syncs.add_step(event)  # --embeddings ps: its bytes a step
            if self._first_step_at is None:
                self._first_step_at = event.time
            self._last_step_at = time.time()
            self._hang = None
            if event.compute_ms is not None:
                row = dataclasses.replace(row, compute_ms=event.compute_ms)
                self._rows[event.rank] = row
                self._judge_speed(event)
                row = self._rows[event.rank]
        elif isinstance(event, PsStats):
            row = dataclasses.replace(row, updates=event.updates, bytes_in=event.bytes_in, bytes_out=event.bytes_out,
                                      params=event.params, step=event.updates, status=ReplicaStatus.RUNNING,
                                      updates_per_s=self._rate(event.rank, event.time, event.updates,
                                                               row.updates_per_s) or 0.0)
        elif isinstance(event, Heartbeat):
            self._where[event.rank] = event.where
            self._beat[event.rank] = time.time()
        elif isinstance(event, Eval):
            self._eval = dict(event.metrics)
        elif isinstance(event, Workload):
            self._workload = event
        elif isinstance(event, Profiled):
            self._profiles.append(event)
        elif isinstance(event, Straggler):  # made by this tracker; replayed by attach
            return
        elif isinstance(event, Resumed):
            self._resumed = event
            self._checkpoint = self._checkpoint or event.path  # the newest complete one until a save
        elif isinstance(event, Checkpointed):
            self._checkpoint = event.path
            self._checkpoint_blocked_ms = max(self._checkpoint_blocked_ms or 0.0, event.blocked_ms)
        elif isinstance(event, Compiled):
            if event.rank == 0:
                self._compiled = event
        elif isinstance(event, AllReduceChosen):
            self._allreduce, self._allreduce_reason = event.algorithm, event.reason
        elif isinstance(event, Synced):
            self._syncs.add(event)
        elif isinstance(event, MembershipChanged):
            self._steps_lost += event.steps_lost
            self._changes.append(event)
        elif isinstance(event, Done):
            self._done[event.rank] = event
            row = dataclasses.replace(row, status=ReplicaStatus.DONE,
                                      peak_mem_mb=max(row.peak_mem_mb, event.peak_mem_mb or 0.0))
        elif isinstance(event, Failed):
            row = dataclasses.replace(row, status=ReplicaStatus.FAILED)
        elif isinstance(event, Exited):
            if event.returncode != 0 and row.status not in (ReplicaStatus.FAILED, ReplicaStatus.DONE):
                row = dataclasses.replace(row, status=ReplicaStatus.STOPPED)
        self._rows[event.rank] = row

    def _judge_speed(self, event: Step) -> None:
        """Feed the straggler watch; a rank that became (or stopped being) slow gets an event."""
        self._stragglers.observe(event.rank, event.compute_ms or 0.0)
        running = [rank for rank, row in self._rows.items()
                   if row.role == "worker" and row.status is ReplicaStatus.RUNNING]
        for verdict in self._stragglers.judge(running):
            self._straggler_events.append(Straggler(
                rank=verdict.rank, time=event.time, host=self._rows[verdict.rank].host, ratio=round(verdict.ratio, 3),
                compute_ms=round(verdict.compute_ms, 3), median_ms=round(verdict.median_ms, 3),
                intervals=verdict.intervals, recovered=verdict.recovered))
        for rank, row in list(self._rows.items()):
            slow = self._stragglers.slow.get(rank)
            if row.slow != slow:
                self._rows[rank] = dataclasses.replace(row, slow=slow)

    def take_made(self) -> list[Event]:
        """Events this tracker made from the stream (stragglers named), for the stream's reader."""
        made, self._straggler_events = list(self._straggler_events), []
        return made

    def _rate(self, rank: int, at: float, count: int, previous: float | None) -> float | None:
        """Counts per second since this rank's previous figure (the previous rate if too close)."""
        last = self._rates.get(rank)
        self._rates[rank] = (at, count)
        if last is None or at - last[0] <= 0 or count < last[1]:
            return previous
        return (count - last[1]) / (at - last[0])

    def check_hang(self, timeout_s: float, heartbeat_s: float) -> Hung | None:
        """A new Hung event if no rank has stepped for ``timeout_s`` (once per stall)."""
        now = time.time()
        trainers = {r: row for r, row in self._rows.items() if row.role == "worker"}  # ps tasks never step
        running = [r for r, row in sorted(trainers.items()) if row.status is ReplicaStatus.RUNNING]
        if self._hang is not None or not running or len(running) < len(trainers):
            return None
        since = self._last_step_at or max((self._seen.get(r, self._t0) for r in running), default=self._t0)
        if now - since < timeout_s:
            return None
        silent_after_s = 3 * heartbeat_s
        culprits, waiting = [], []
        for rank in running:
            silent = now - self._beat.get(rank, self._t0) > silent_after_s
            (culprits if silent or not self._where.get(rank, "").startswith("torch") else waiting).append(rank)
        if culprits:
            rank = culprits[0]
            silent = now - self._beat.get(rank, self._t0) > silent_after_s
            where = (f"no heartbeat for {now - self._beat.get(rank, self._t0):.0f} s (stuck outside Python?)"
                     if silent else f"in {self._where.get(rank, 'distrun')}")
        else:
            rank, where = -1, "every rank waits inside torch (a collective that no rank completes?)"
        return Hung(rank=rank, time=now, stalled_s=now - since, where=where, waiting=tuple(waiting))

    def snapshot(self) -> JobSnapshot:
        now = time.time()
        rows = tuple(
            dataclasses.replace(r, last_seen_s=now - self._seen.get(r.rank, self._t0))
            for _, r in sorted(self._rows.items())
        )
        return JobSnapshot(
            recipe=self._recipe,
            strategy=self._strategy,
            rows=rows,
            step=max((r.step for r in rows), default=0),
            total_steps=max(self._totals.values(), default=None),
            elapsed_s=now - self._t0,
            eval_metrics=dict(self._eval),
            last_checkpoint=self._checkpoint,
            hang=describe_hang(self._hang, self._rows) if self._hang else None,
            evaluator_step=self._evaluator[0] if self._evaluator else None,
            evaluator_metrics=dict(self._evaluator[1]) if self._evaluator else {},
            compile_line=describe_compile(self._compiled) if self._compiled else None,
            membership_line=describe_membership(self._changes[-1], len(self._changes)) if self._changes else None,
            straggler_line=describe_stragglers(rows, self._stragglers.slow),
            mesh=self._mesh,
            sync_line=self._syncs.line(),
            lr=self._lr,
            micro_batch=self._micro_batch,
            **self._throughput(sum(r.samples_per_s for r in rows if r.role == "worker")),
        )

    def summary(self, status: str, error: str | None = None) -> JobSummary:
        chief = self._done.get(0)
        first = chief.first_step_time if chief and chief.first_step_time else self._first_step_at
        steps = chief.steps if chief else max((r.step for r in self._rows.values() if r.role == "worker"), default=0)
        # A job that ended before its chief said done (interrupted, failed): what the live table last showed.
        last = self._rows.get(0)
        workers_rate = sum(r.samples_per_s for r in self._rows.values() if r.role == "worker")
        return JobSummary(
            status=status,
            recipe=self._recipe,
            strategy=self._strategy,
            replicas=self._mesh["dp"] if self._mesh else self._replicas,
            mesh=self._mesh,
            micro_batch_size=self._micro_batch[0] if self._micro_batch else None,
            accumulate=self._micro_batch[1] if self._micro_batch else 1,
            steps=steps,
            final_loss=chief.final_loss if chief else (last.loss if last is not None else None),
            samples_per_s=chief.samples_per_s if chief else workers_rate,
            time_to_first_step_s=(first - self._t0) if first else None,
            wall_s=time.time() - self._t0,
            eval_metrics=dict(self._eval),
            last_checkpoint=self._checkpoint,
            checkpoint_blocked_ms=self._checkpoint_blocked_ms,
            error=error,
            evaluator_step=self._evaluator[0] if self._evaluator else None,
            evaluator_metrics=dict(self._evaluator[1]) if self._evaluator else {},
            precision=self._precision,
            compile=self._compile_summary(),
            compression=self._compression,
            allreduce=self._allreduce,
            allreduce_reason=self._allreduce_reason,
            membership_changes=len(self._changes),
            steps_lost=self._steps_lost,
            recovery_s=max((c.recovery_s for c in self._changes), default=None),
            world_size=self._changes[-1].world_size if self._changes else (
                self._mesh["dp"] if self._mesh else self._replicas),
            peak_mem_mb={str(rank): round(row.peak_mem_mb, 1) for rank, row in sorted(self._rows.items())
                         if row.peak_mem_mb > 0},
            stragglers={str(rank): round(ratio, 2) for rank, ratio in sorted(self._stragglers.worst.items())},
            profile_dir=os.path.dirname(self._profiles[0].path) if self._profiles else None,
            profile_traces=len(self._profiles),
            recipe_kind=self._recipe_kind,
            resumed=({"path": self._resumed.path, "step": self._resumed.step, "past_end": self._resumed.past_end}
                     if self._resumed else None),
            net_mb_sent=self._net_mb_sent(),
            reason=self._stopped_by(),
            **self._syncs.summary(self._strategy == "diloco"),
            **self._throughput(chief.samples_per_s if chief else workers_rate),
        )

    def _stopped_by(self) -> str | None:
        """A run a recipe's callback ended early: what the lowest rank whose callback stopped it said."""
        return next((done.reason for _, done in sorted(self._done.items()) if done.reason), None)

    def _net_mb_sent(self) -> float | None:
        """Each host's largest count from its ranks' Done (they read one host's counters), summed."""
        per_host: dict[str | None, int] = {}
        for rank, done in self._done.items():
            if done.net_bytes_sent is not None:
                host = self._rows[rank].host if rank in self._rows else None
                per_host[host] = max(per_host.get(host, 0), done.net_bytes_sent)
        return round(sum(per_host.values()) / 1e6, 3) if per_host else None

    def _throughput(self, samples_per_s: float) -> dict[str, float | None]:
        """tokens/s and MFU from samples/s, where the recipe said what a sample is worth."""
        work = self._workload
        if work is None or samples_per_s <= 0:
            return {"tokens_per_s": None, "mfu": None}
        tokens = samples_per_s * work.tokens_per_sample
        mfu = (tokens * work.flops_per_token / (work.peak_flops * work.devices)
               if work.flops_per_token and work.peak_flops else None)
        return {"tokens_per_s": tokens, "mfu": mfu}

    def _compile_summary(self) -> dict[str, object] | None:
        if self._compile_mode is None and self._compiled is None:
            return None
        figures = self._compiled
        return {"mode": self._compile_mode or "default",
                "compile_s": figures.compile_s if figures else None,
                "graphs": figures.graphs if figures else 0,
                "graph_breaks": figures.graph_breaks if figures else 0,
                "recompiles": figures.recompiles if figures else 0}


def describe_compile(event: Compiled) -> str:
    """One line for the live view: what the compiler did on the chief, breaks named."""
    line = (f"compiled: {event.graphs} graph(s) in {event.compile_s:.1f} s, {event.graph_breaks} graph break(s), "
            f"{event.recompiles} recompilation(s)")
    if event.reasons:
        line += f"; first break: {event.reasons[0]}"
    return line


def describe_membership(change: MembershipChanged, count: int) -> str:
    """One line for the live view: the newest change of an elastic job's group."""
    what = "; ".join(part for part in (("left: " + ", ".join(change.left)) if change.left else "",
                                       ("joined: " + ", ".join(change.joined)) if change.joined else "") if part)
    return (f"membership: {change.world_size} replica(s) from step {change.step + 1} ({what or 'regrouped'}; "
            f"recovered in {change.recovery_s:.2f} s; change {count})")


def describe_stragglers(rows: tuple[ReplicaRow, ...], slow: dict[int, float]) -> str | None:
    """One line for the live view: the slow ranks, where they run and how much slower they compute."""
    if not slow:
        return None
    named = []
    for row in rows:
        if row.rank in slow:
            where = f" ({row.host})" if row.host else ""
            named.append(f"rank {row.rank}{where} {slow[row.rank]:.2f}x")
    return (f"straggler: {', '.join(named)} the other ranks' median compute time per step "
            f"(for {SLOW_INTERVALS}+ intervals)")


def describe_hang(hang: Hung, rows: dict[int, ReplicaRow]) -> str:
    """One line for the live view: who is stuck, where, and who waits for it."""
    def name(rank: int) -> str:
        host = rows[rank].host if rank in rows else None
        return f"rank {rank}" + (f" ({host})" if host else "")

    waiting = ", ".join(name(rank) for rank in hang.waiting)
    if hang.rank < 0:
        return f"no progress for {hang.stalled_s:.0f} s: {hang.where}"
    tail = f"; waiting for it: {waiting}" if waiting else ""
    return f"no progress for {hang.stalled_s:.0f} s: {name(hang.rank)} is stuck {hang.where}{tail}"
