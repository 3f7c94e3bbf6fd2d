"""``--tp``, ``--pp`` and ``--activation-checkpointing``: which strategies take them, what they refuse.

A replica may span several ranks (TensorFlow's logical devices per replica): ``--tp N`` splits
each layer over N ranks, ``--pp P`` splits the layer stack into P pipeline stages, so a job
runs ``replicas x tp x pp`` ranks, and ``--replicas`` stays the data-parallel degree. Only
the strategies whose replicas step in lockstep over one process group take them: mirrored and
multi-worker (replicated over the data-parallel ranks) and sharded (sharded over them). Each
refusal below says why in one line (docs/strategies.md#model-parallel---tp).
"""

from __future__ import annotations

from typing import Any

from distrun.errors import ConfigError

__all__ = ["ACTIVATION_CHECKPOINTING", "MODEL_PARALLEL_STRATEGIES", "PP_SCHEDULES", "stages_per_rank",
           "stages_of_rank", "rank_of_stage", "validate_parallel"]

#: ``--pp-schedule``: torch.distributed.pipelining's schedules by distrun's names. The
#: interleaved ones hold two stages on each rank (fewer idle slots, more messages), looped
#: (rank r: stages r and r + P); the V-shaped ones hold two as a V (rank r: stages r and
#: 2P - 1 - r, so the first and the last stage share rank 0, and the middle turn is local).
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipe-v")
_INTERLEAVED = ("interleaved-1f1b", "zero-bubble")
_V_SHAPED = ("zbv", "dualpipe-v")
#: Schedules whose backward is split into an input and a weight pass: torch refuses compiled stages.
_SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipe-v")


def stages_per_rank(schedule: str) -> int:
    """How many pipeline stages each rank holds under ``schedule``."""
    return 2 if schedule in _INTERLEAVED + _V_SHAPED else 1


def stages_of_rank(schedule: str, rank: int, pp: int) -> list[int]:
    """The stages pipeline rank ``rank`` (of ``pp``) holds under ``schedule``, in order."""
    if schedule in _V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(stages_per_rank(schedule))]


def rank_of_stage(schedule: str, stage: int, pp: int) -> int:
    """The pipeline rank that holds ``stage`` under ``schedule`` (``stages_of_rank`` inverted)."""
    if schedule in _V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def _microbatch_problem(schedule: str, microbatches: int, pp: int) -> str | None:
    """Why ``schedule`` cannot run ``microbatches`` over ``pp`` ranks (torch's own rules), or None."""
    if schedule == "1f1b" and microbatches < pp:
        return f"1F1B needs at least one microbatch per stage ({pp})"
    if schedule in _INTERLEAVED:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return f"{schedule} runs microbatches in rounds of {pp}: give a multiple of {pp}, or fewer than {pp}"
    if schedule == "dualpipe-v" and microbatches < 2 * pp:
        return f"DualPipeV needs at least one microbatch per stage ({2 * pp}: two stages a rank)"
    return None

#: ``--activation-checkpointing``: keep every activation, recompute each unit's in backward,
#: or recompute only the cheap ones (elementwise, norms) and keep the matmuls' outputs.
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
#: The strategies ``--tp`` composes with (by their --strategy names).
MODEL_PARALLEL_STRATEGIES = ("mirrored", "multi-worker", "sharded")

#: Why the others do not take --tp, by --strategy name.
_WHY_NOT = {
    "one-device": "one-device runs one rank; a split layer needs several: use --strategy mirrored --tp N "
                  "(--replicas 1 by default)",
    "central-storage": "its replicas hold no parameters of their own (the chief's copy is stepped), so there is "
                       "no replica to split; use --strategy mirrored --tp N",
    "parameter-server": "each worker pulls whole parameters from the ps tasks and steps on its own, with no "
                        "group to split a layer over; use --strategy sharded --tp N",
    "diloco": "each replica steps alone between syncs, a whole model on one rank; use --strategy multi-worker "
              "--tp N (or --pp N between hosts)",
}

#: Flags of DDP's all-reduce: under --tp the data-parallel dimension is FSDP2's (replicated for
#: mirrored), where DDP's hooks and SyncBatchNorm do not go.
_DDP_ONLY = (
    ("--compression", lambda spec: spec.communication.compression_spec.active),
    ("--allreduce", lambda spec: spec.communication.allreduce != "flat"),
    ("--sync-batch-norm", lambda spec: spec.strategy.sync_batch_norm),
)


def validate_parallel(spec: Any) -> None:
    """Refuse, in one line naming the flag, what ``--tp``/``--pp``/``--activation-checkpointing`` cannot do."""
    parallel = spec.parallel
    for flag, value in (("--tp", parallel.tp), ("--pp", parallel.pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag}: expected a positive whole number of ranks. Received: {value!r}")
    _validate_pipeline(spec)
    tp = parallel.tp
    if parallel.loss_parallel and tp < 2:
        raise ConfigError("--loss-parallel computes the loss on each tensor-parallel rank's slice of the logits: it "
                          "needs --tp 2 or more")
    if parallel.loss_parallel and parallel.pp > 1:
        raise ConfigError("--loss-parallel with --pp: not yet (the last stage gathers its logits); drop one of them")
    if parallel.sequence_parallel and tp < 2:
        raise ConfigError("--sequence-parallel splits the activations between tensor-parallel layers by sequence "
                          "position over the --tp ranks: it needs --tp 2 or more")
    if parallel.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ConfigError(f"--activation-checkpointing: expected {', '.join(ACTIVATION_CHECKPOINTING)}. "
                          f"Received: {parallel.activation_checkpointing!r}")
    name = spec.strategy.name.value
    if parallel.activation_checkpointing != "none" and name == "parameter-server":
        raise ConfigError("--activation-checkpointing with --strategy parameter-server: its workers pull parameters "
                          "in forward hooks, which a recomputed forward would run again; use a synchronous strategy")
    if tp == 1 and parallel.pp == 1:
        return
    flag = "--tp" if tp > 1 else "--pp"
    if name not in MODEL_PARALLEL_STRATEGIES:
        raise ConfigError(f"{flag} with --strategy {name}: {_WHY_NOT[name].replace('--tp N', flag + ' N')}")
    if spec.strategy.elastic:
        raise ConfigError(f"{flag} with --elastic: a lost rank takes a piece of every layer (or a stage) of its "
                          f"replica with it, so no replica could go on; run {flag} without --elastic (with "
                          "--max-restarts on a cluster)")
    for ddp_flag, used in _DDP_ONLY:
        if used(spec):
            raise ConfigError(f"{ddp_flag} with {flag}: it configures DDP's gradient all-reduce, and under {flag} "
                              "the replicas meet through FSDP2's collectives instead")


def _validate_pipeline(spec: Any) -> None:
    """``--pp-schedule`` and ``--microbatches``: known, and what the schedule and the batch allow."""
    parallel = spec.parallel
    if parallel.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(f"--pp-schedule: expected {', '.join(PP_SCHEDULES)}. Received: {parallel.pp_schedule!r}")
    microbatches = parallel.microbatches
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 0:
        raise ConfigError(f"--microbatches: expected a positive whole number. Received: {microbatches!r}")
    if parallel.pp == 1:
        used = [flag for flag, on in (("--pp-schedule", parallel.pp_schedule != "1f1b"),
                                      ("--microbatches", microbatches != 0)) if on]
        if used:
            raise ConfigError(f"{used[0]} is for pipeline parallel: it needs --pp 2 or more")
        return
    count = parallel.pipeline_microbatches
    problem = _microbatch_problem(parallel.pp_schedule, count, parallel.pp)
    if problem:
        raise ConfigError(f"--microbatches {count}: {problem}")
    if spec.precision.compile and parallel.pp_schedule in _SPLIT_BACKWARD:
        raise ConfigError(f"--compile with --pp-schedule {parallel.pp_schedule}: its backward is split in two (inputs, "
                          "then weights), which torch does not run on compiled stages; use 1f1b, gpipe or "
                          "interleaved-1f1b")
    if spec.precision.name == "fp16":
        raise ConfigError("--precision fp16 with --pp: the loss scaler scales one model's output, and a pipeline's "
                          "output is on its last stage only; use --precision bf16 (no scaler needed)")
    batch, replicas = spec.training.global_batch_size, spec.strategy.replicas
    if batch is not None and (batch // replicas) % count:
        per = batch // replicas
        raise ConfigError(f"--microbatches {count}: a replica's batch of {per} (--global-batch-size "
                          f"{batch} over {replicas} replica(s)) does not split into {count} "
                          "equal microbatches")
