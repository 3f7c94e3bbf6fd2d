"""The job spec: what one `distrun train` run asks for, validated before anything starts.

A JobSpec is a frozen value. The CLI builds it from flags (recipe defaults fill
what the flags leave out), the launcher hands it to every training process as
JSON, and the runtime reads it back; nothing mutates it on the way.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from distrun.config._compression import DEFAULT_POWERSGD_WARMUP, Compression
from distrun.config._diloco import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, DEFAULT_SYNC_EVERY, validate_diloco
from distrun.config._observe import check_profile, check_spec_trackers
from distrun.config._parallel import validate_parallel
from distrun.config._suggest import did_you_mean
from distrun.errors import ConfigError

__all__ = ["StrategyName", "JobSpec", "DEFAULT_CPU_REPLICAS", "DEFAULT_KEEP_CHECKPOINTS", "DEFAULT_PS_PARTITION_MB",
           "PRECISIONS", "COMPILE_MODES", "ALLREDUCE_ALGORITHMS"]

#: Replicas started on a machine without GPUs when --replicas is not given: two is
#: the smallest count that exercises the distributed path (documented in docs/cli.md).
DEFAULT_CPU_REPLICAS = 2
DEFAULT_KEEP_CHECKPOINTS = 3
#: Parameters bigger than this are split by rows across the ps tasks (docs/parameter-server.md).
DEFAULT_PS_PARTITION_MB = 64.0
#: ``--precision``: fp32, or autocast to bf16 / fp16 around forward and loss (docs/precision.md).
PRECISIONS = ("fp32", "bf16", "fp16")
#: ``--allreduce``: DDP's flat ring, inside each host then across hosts, or whichever of the two
#: measures faster on the job's own buckets (docs/communication.md).
ALLREDUCE_ALGORITHMS = ("flat", "hierarchical", "auto")
#: ``--compile-mode``: torch.compile's own modes.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


class StrategyName(str, Enum):
    """The strategies, by the name ``--strategy`` takes (``ps`` is parameter-server's alias,
    ``fsdp`` sharded's)."""

    ONE_DEVICE = "one-device"
    MIRRORED = "mirrored"
    MULTI_WORKER = "multi-worker"
    CENTRAL_STORAGE = "central-storage"
    PARAMETER_SERVER = "parameter-server"
    SHARDED = "sharded"
    DILOCO = "diloco"

    @classmethod
    def parse(cls, value: str) -> StrategyName:
        try:
            return cls(_ALIASES.get(value, value))
        except ValueError:
            names = [s.value for s in cls]
            raise ConfigError(
                f"--strategy: unknown strategy {value!r}{did_you_mean(value, names)}; "
                f"choose one of {', '.join(names)}"
            ) from None

    @property
    def distributed(self) -> bool:
        return self is not StrategyName.ONE_DEVICE

    @property
    def collective(self) -> bool:
        """Every replica joins one process group (all but parameter-server, whose workers
        talk only to ps tasks, so that one of them can die without stopping the others)."""
        return self.distributed and self is not StrategyName.PARAMETER_SERVER


_ALIASES = {"ps": StrategyName.PARAMETER_SERVER.value, "fsdp": StrategyName.SHARDED.value}


@dataclass(frozen=True)
class JobSpec:
    """Everything a training process needs to know about the job it belongs to."""

    recipe: str
    strategy: StrategyName = StrategyName.ONE_DEVICE
    replicas: int = 1
    device: str = "cpu"
    steps: int | None = None
    epochs: int | None = None
    global_batch_size: int | None = None
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    resume: bool = False
    sync_batch_norm: bool = False
    recipe_args: tuple[str, ...] = ()
    log_interval_s: float = 0.25
    extra_env: Mapping[str, str] = field(default_factory=dict)
    #: parameter-server only: ps tasks (the job runs ``replicas`` workers plus these),
    #: synchronous rounds, the staleness bound, and the size above which a parameter
    #: is split by rows across every ps task.
    ps_tasks: int = 0
    ps_sync: bool = False
    max_staleness: int | None = None
    ps_partition_mb: float = DEFAULT_PS_PARTITION_MB
    #: a replica's step: autocast precision, and torch.compile of the prepared model.
    precision: str = "fp32"
    compile: bool = False
    compile_mode: str = "default"
    #: gradient communication (mirrored, multi-worker): ``none|fp16|bf16|powersgd[:RANK]``,
    #: and PowerSGD's plain all-reduce steps before it starts.
    compression: str = "none"
    powersgd_warmup: int = DEFAULT_POWERSGD_WARMUP
    #: how gradients meet across hosts (multi-worker): DDP's flat ring, or hierarchical.
    allreduce: str = "flat"
    #: ``--elastic MIN:MAX`` (0: not elastic): replicas may leave and join while at least
    #: MIN remain, up to MAX (counted in replicas; the CLI turns hosts into replicas).
    elastic_min: int = 0
    elastic_max: int = 0
    #: a NaN or Inf loss: stop the job naming step and rank, skip the update everywhere, or warn.
    on_nonfinite: str = "stop"
    #: ``--tensorboard DIR``: rank 0 (and each ps task) write event files there; on a cluster
    #: the chief host's server points it at the job's folder, and the client brings them home.
    tensorboard_dir: str | None = None
    #: sharded only: free each unit's gathered parameters after its forward (FSDP's
    #: reshard_after_forward); shard over every rank or inside each host (HSDP); keep the
    #: shards and the optimizer's state in host memory (``cpu``: FSDP's CPUOffloadPolicy).
    reshard_after_forward: bool = True
    shard_within: str = "auto"
    offload: str = "none"
    #: sharded only: write each checkpoint in the background (DCP's ``async_save``): a step
    #: waits only while the shards are copied out of the model.
    async_checkpoint: bool = False
    #: fit recipes: DataLoader worker processes per rank reading train_data (0: in the rank).
    data_workers: int = 0
    #: ``--clip-grad-norm MAX``: the gradients' global norm clipped to MAX before each step.
    clip_grad_norm: float | None = None
    #: SIGUSR1 to a rank (Slurm's warning before a time limit or a preemption) asks the job to
    #: write a checkpoint at a step every replica agrees on, then stop (exit 75) to be requeued.
    preemptible: bool = False
    #: ``--profile START:END``: torch.profiler on every rank over these global steps (inclusive);
    #: each rank's trace goes to ``profile_dir`` (the client picks it; a cluster host, its job folder).
    profile_steps: tuple[int, int] | None = None
    profile_dir: str | None = None
    #: ``--tracker``: what rank 0 logs to besides the live view (mlflow, wandb; tensorboard is
    #: ``tensorboard_dir``); where each writes (``--tracker-uri``), the run's name, the experiment
    #: (MLflow's experiment, W&B's project), and whether the newest checkpoint is logged at the end.
    trackers: tuple[str, ...] = ()
    tracker_uris: Mapping[str, str] = field(default_factory=dict)
    run_name: str | None = None
    experiment: str | None = None
    tracker_checkpoint: bool = False
    #: ``--tp N``: each replica's layers split over N ranks (mirrored, multi-worker, sharded), so
    #: the job runs ``replicas x tp`` ranks; ``replicas`` stays the data-parallel degree.
    tp: int = 1
    #: ``--sequence-parallel``: under ``--tp``, the activations between the split layers are split
    #: by sequence position over the tensor-parallel ranks too (norms and dropout run on a slice).
    sequence_parallel: bool = False
    #: ``--loss-parallel``: under ``--tp``, the plan's ``output`` layer keeps its logits split by
    #: class, and the loss is computed on each rank's slice (torch's ``loss_parallel``).
    loss_parallel: bool = False
    #: ``--pp P``: each replica's layer chain cut into P pipeline stages (a rank each, or two under
    #: the interleaved schedules); ``pp_schedule`` orders the microbatches, ``microbatches``
    #: splits each replica's batch (0: twice ``pp``).
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int = 0
    #: ``--activation-checkpointing``: none | full | selective, on each block (config/_parallel.py).
    activation_checkpointing: str = "none"
    #: ``--strategy diloco`` (config/_diloco.py): inner steps between syncs, the outer optimizer
    #: (SGD, Nesterov unless momentum is 0), what pseudo-gradients cross the wire as, and the
    #: fragments streaming DiLoCo syncs one at a time.
    sync_every: int = DEFAULT_SYNC_EVERY
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    sync_dtype: str = "fp32"
    fragments: int = 1
    #: ``--eval-every N``: fit recipes with ``eval_data`` evaluate every N steps (and always at the end).
    eval_every: int | None = None

    @property
    def elastic(self) -> bool:
        return self.elastic_min > 0

    @property
    def ranks_per_replica(self) -> int:
        """Ranks one replica spans: its tensor-parallel times its pipeline degree (1 without either)."""
        return self.tp * self.pp

    @property
    def pipeline_microbatches(self) -> int:
        """``--microbatches``, or its default: two per pipeline rank."""
        return self.microbatches or 2 * self.pp

    @property
    def trainer_ranks(self) -> int:
        """Ranks that train (every replica's), before any ps task."""
        return self.replicas * self.ranks_per_replica

    @property
    def mesh(self) -> dict[str, int]:
        """The job's degrees as the summary and the live view show them."""
        return {"dp": self.replicas, "tp": self.tp, **({"pp": self.pp} if self.pp > 1 else {})}

    @property
    def world_size(self) -> int:
        """Processes in the job: the training ranks (workers), then the ps tasks."""
        return self.trainer_ranks + self.ps_tasks

    @property
    def compression_spec(self) -> Compression:
        return Compression.parse(self.compression)

    @property
    def ps_partition_bytes(self) -> int:
        return int(self.ps_partition_mb * 2**20)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def per_replica_batch_size(self) -> int | None:
        if self.global_batch_size is None:
            return None
        return self.global_batch_size // self.replicas

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["strategy"] = self.strategy.value
        data["recipe_args"] = list(self.recipe_args)
        data["extra_env"] = dict(self.extra_env)
        data["tracker_uris"] = dict(self.tracker_uris)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        data: dict[str, Any] = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"job spec: unknown keys {unknown} (client and worker versions differ?)")
        data["strategy"] = StrategyName.parse(data.get("strategy", "one-device"))
        data["recipe_args"] = tuple(data.get("recipe_args", ()))
        data["trackers"] = tuple(data.get("trackers", ()))
        if data.get("profile_steps") is not None:  # JSON brings a list
            data["profile_steps"] = tuple(data["profile_steps"])
        return cls(**data)


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{name}: expected a positive whole number. Received: {value!r}")


def _validate(spec: JobSpec) -> None:
    if not isinstance(spec.strategy, StrategyName):
        raise ConfigError(f"--strategy: expected a StrategyName. Received: {spec.strategy!r}")
    if not os.path.isabs(spec.recipe):
        raise ConfigError(f"recipe path must be absolute inside a job spec. Received: {spec.recipe!r}")
    _positive("--replicas", spec.replicas)
    _positive("--steps", spec.steps)
    _positive("--epochs", spec.epochs)
    _positive("--global-batch-size", spec.global_batch_size)
    _positive("--checkpoint-every", spec.checkpoint_every)
    _positive("--keep-checkpoints", spec.keep_checkpoints)
    _positive("--eval-every", spec.eval_every)
    if spec.data_workers < 0:
        raise ConfigError(f"--data-workers: expected 0 or more worker processes. Received: {spec.data_workers}")
    if spec.device not in ("cpu", "cuda"):
        raise ConfigError(f"device: expected 'cpu' or 'cuda'. Received: {spec.device!r}")
    if spec.steps is not None and spec.epochs is not None:
        raise ConfigError("--steps and --epochs are exclusive: give one")
    if spec.strategy is StrategyName.ONE_DEVICE and spec.replicas != 1:
        raise ConfigError(
            f"--strategy one-device runs one replica. Received: --replicas {spec.replicas}; "
            "use --strategy mirrored for more"
        )
    if spec.global_batch_size is not None and spec.global_batch_size % spec.replicas:
        raise ConfigError(
            f"--global-batch-size {spec.global_batch_size} is not divisible by {spec.replicas} replicas; "
            f"choose a multiple of {spec.replicas}"
        )
    if (spec.resume or spec.checkpoint_every) and not spec.checkpoint_dir:
        flag = "--resume" if spec.resume else "--checkpoint-every"
        raise ConfigError(f"{flag} needs --checkpoint-dir")
    _validate_ps(spec)
    _validate_step(spec)
    validate_diloco(spec)  # before the general checks: its refusals say what diloco does instead
    _validate_compression(spec)
    _validate_allreduce(spec)
    _validate_elastic(spec)
    _validate_sharded(spec)
    _validate_preemptible(spec)
    validate_parallel(spec)
    check_profile(spec.profile_steps, spec.steps)
    check_spec_trackers(spec.trackers, spec.tracker_uris, log_checkpoint=spec.tracker_checkpoint,
                        checkpoint_dir=spec.checkpoint_dir)
    if spec.on_nonfinite not in ("stop", "skip", "warn"):
        raise ConfigError(f"--on-nonfinite: expected stop, skip or warn. Received: {spec.on_nonfinite!r}"
                          f"{did_you_mean(str(spec.on_nonfinite), ('stop', 'skip', 'warn'))}")
    if spec.log_interval_s < 0:
        raise ConfigError(f"log interval must be >= 0 s. Received: {spec.log_interval_s!r}")


def _validate_ps(spec: JobSpec) -> None:
    if spec.strategy is not StrategyName.PARAMETER_SERVER:
        used = [flag for flag, on in (("--ps-tasks", spec.ps_tasks), ("--ps-sync", spec.ps_sync),
                                      ("--max-staleness", spec.max_staleness is not None)) if on]
        if used:
            raise ConfigError(f"{used[0]} is for --strategy parameter-server. Received: --strategy {spec.strategy.value}")
        return
    if spec.ps_tasks < 1:
        raise ConfigError(f"--strategy parameter-server needs at least one ps task. Received: {spec.ps_tasks}")
    if spec.max_staleness is not None:
        if isinstance(spec.max_staleness, bool) or not isinstance(spec.max_staleness, int) or spec.max_staleness < 0:
            raise ConfigError(f"--max-staleness: expected 0 or more steps. Received: {spec.max_staleness!r}")
        if spec.ps_sync:
            raise ConfigError("--max-staleness bounds asynchronous training; --ps-sync has no staleness: give one")
    if not spec.ps_partition_mb > 0:
        raise ConfigError(f"--ps-partition-mb: expected a positive size. Received: {spec.ps_partition_mb!r}")


def _validate_step(spec: JobSpec) -> None:
    if spec.precision not in PRECISIONS:
        raise ConfigError(f"--precision: expected {', '.join(PRECISIONS)}. Received: {spec.precision!r}"
                          f"{did_you_mean(str(spec.precision), PRECISIONS)}")
    if spec.compile_mode not in COMPILE_MODES:
        raise ConfigError(f"--compile-mode: expected {', '.join(COMPILE_MODES)}. Received: {spec.compile_mode!r}"
                          f"{did_you_mean(str(spec.compile_mode), COMPILE_MODES)}")
    if spec.compile_mode != "default" and not spec.compile:
        raise ConfigError(f"--compile-mode {spec.compile_mode} needs --compile")
    if spec.clip_grad_norm is not None:
        value = spec.clip_grad_norm
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ConfigError(f"--clip-grad-norm: expected a positive norm. Received: {value!r}")
        if spec.strategy is StrategyName.PARAMETER_SERVER:
            raise ConfigError("--clip-grad-norm with --strategy parameter-server: the ps tasks step each push "
                              "alone, so no step sees the gradients' global norm; clip in the recipe's loss")
    if spec.strategy is StrategyName.PARAMETER_SERVER:
        if spec.compile:
            raise ConfigError("--compile: parameter-server workers pull parameters in forward hooks and swap "
                              "embedding forwards per batch, which torch.compile cannot trace; "
                              "use it with one-device, mirrored, multi-worker or central-storage")
        if spec.precision == "fp16" and spec.ps_sync:
            raise ConfigError("--precision fp16 with --ps-sync: a worker that skips an overflowing step would "
                              "hold up the round; use --precision bf16, or fp16 without --ps-sync")


#: Strategies whose replicas all-reduce gradients through DDP, where a communication hook applies.
_COMPRESSIBLE = (StrategyName.MIRRORED, StrategyName.MULTI_WORKER)


def _validate_compression(spec: JobSpec) -> None:
    compression = spec.compression_spec
    if isinstance(spec.powersgd_warmup, bool) or not isinstance(spec.powersgd_warmup, int) \
            or spec.powersgd_warmup < 2:
        raise ConfigError(f"--powersgd-warmup: expected 2 or more steps (DDP rebuilds its buckets after the "
                          f"first). Received: {spec.powersgd_warmup!r}")
    if spec.powersgd_warmup != DEFAULT_POWERSGD_WARMUP and compression.kind != "powersgd":
        raise ConfigError("--powersgd-warmup is for --compression powersgd")
    if compression.active and spec.strategy is StrategyName.PARAMETER_SERVER:
        if compression.kind == "powersgd":  # a low-rank sum needs every replica's gradient at once
            raise ConfigError("--compression powersgd: compresses gradients that replicas all-reduce (mirrored, "
                              "multi-worker); parameter-server pushes take --compression fp16|bf16")
        return
    if compression.active and spec.strategy is StrategyName.SHARDED:
        raise ConfigError(f"--compression {compression} with --strategy sharded: FSDP reduce-scatters gradients in "
                          "its own collectives, where a DDP hook cannot go; --precision bf16 gathers parameters in "
                          "bf16 and reduces gradients in fp32")
    if compression.active and spec.strategy not in _COMPRESSIBLE:
        raise ConfigError(f"--compression {compression}: applies where replicas exchange gradients (mirrored, "
                          f"multi-worker, parameter-server); --strategy {spec.strategy.value} has no such exchange")


def _validate_allreduce(spec: JobSpec) -> None:
    if spec.allreduce not in ALLREDUCE_ALGORITHMS:
        raise ConfigError(f"--allreduce: expected {', '.join(ALLREDUCE_ALGORITHMS)}. Received: {spec.allreduce!r}"
                          f"{did_you_mean(str(spec.allreduce), ALLREDUCE_ALGORITHMS)}")
    if spec.allreduce == "flat":
        return
    if spec.allreduce == "auto":  # mirrored and one-host runs are told "flat: one host" by the probe's rules
        if spec.strategy not in _COMPRESSIBLE:
            raise ConfigError(f"--allreduce auto: chooses how replicas all-reduce gradients (mirrored, "
                              f"multi-worker); --strategy {spec.strategy.value} has no such all-reduce")
        return
    if spec.strategy is not StrategyName.MULTI_WORKER:
        raise ConfigError(f"--allreduce {spec.allreduce}: arranges the all-reduce across hosts, for --strategy "
                          f"multi-worker on a cluster; --strategy {spec.strategy.value} runs on one host")
    if spec.compression_spec.kind == "powersgd":
        raise ConfigError("--allreduce hierarchical with --compression powersgd: PowerSGD runs its own "
                          "all-reduces; use --allreduce flat, or --compression fp16|bf16")


SHARD_WITHIN = ("auto", "all", "host")
OFFLOAD = ("none", "cpu")


def _validate_sharded(spec: JobSpec) -> None:
    """``--strategy sharded`` and its flags; what does not combine with it yet, in one line each."""
    if spec.shard_within not in SHARD_WITHIN:
        raise ConfigError(f"--shard-within: expected {' or '.join(SHARD_WITHIN)}. Received: {spec.shard_within!r}")
    if spec.offload not in OFFLOAD:
        raise ConfigError(f"--offload: expected {' or '.join(OFFLOAD)}. Received: {spec.offload!r}")
    if spec.strategy is not StrategyName.SHARDED:
        used = [flag for flag, on in (("--shard-within", spec.shard_within != "auto"),
                                      ("--offload", spec.offload != "none"),
                                      ("--no-reshard-after-forward", not spec.reshard_after_forward),
                                      ("--async-checkpoint", spec.async_checkpoint)) if on]
        if used:
            raise ConfigError(f"{used[0]} is for --strategy sharded. Received: --strategy {spec.strategy.value}")
        return
    refused = [(flag, why) for flag, why, on in (
        ("--sync-batch-norm", "sharded keeps no replica-wide BatchNorm statistics", spec.sync_batch_norm),
        ("--offload cpu", "it moves shards off a GPU into host memory, and a CPU job holds them there already",
         spec.offload == "cpu" and spec.device != "cuda"),
    ) if on]
    if refused:
        raise ConfigError(f"{refused[0][0]} with --strategy sharded: {refused[0][1]}")
    if spec.async_checkpoint and not spec.checkpoint_dir:
        raise ConfigError("--async-checkpoint needs --checkpoint-dir")


def _validate_preemptible(spec: JobSpec) -> None:
    """A job that checkpoints when told it will end: the checkpoint needs somewhere to go, and the
    replicas need to agree on a step (parameter-server workers never agree on one)."""
    if not spec.preemptible:
        return
    if not spec.checkpoint_dir:
        raise ConfigError("--requeue needs --checkpoint-dir (on storage every node shares): the job resumes from it")
    if spec.strategy is StrategyName.PARAMETER_SERVER or spec.elastic:
        what = "--elastic" if spec.elastic else "--strategy parameter-server"
        raise ConfigError(f"--requeue with {what}: its replicas never agree on one step to checkpoint at")


def _validate_elastic(spec: JobSpec) -> None:
    """``--elastic``: what membership changes can carry over today (docs/elastic.md says why)."""
    if not spec.elastic:
        if spec.elastic_max:
            raise ConfigError(f"--elastic: MAX {spec.elastic_max} without MIN")
        return
    if spec.strategy not in (StrategyName.MIRRORED, StrategyName.MULTI_WORKER, StrategyName.DILOCO):
        raise ConfigError(f"--elastic: for --strategy mirrored, multi-worker or diloco (replicas that each hold "
                          f"the whole state). Received: --strategy {spec.strategy.value}")
    if not 1 <= spec.elastic_min <= spec.replicas <= spec.elastic_max:
        raise ConfigError(f"--elastic {spec.elastic_min}:{spec.elastic_max}: needs 1 <= MIN <= the {spec.replicas} "
                          f"replica(s) the job starts with <= MAX")
    blocked = [flag for flag, used in (("--compile", spec.compile),
                                       ("--compression powersgd", spec.compression_spec.kind == "powersgd"),
                                       (f"--allreduce {spec.allreduce}", spec.allreduce != "flat")) if used]
    if blocked:
        raise ConfigError(f"--elastic with {blocked[0]}: not supported yet (a new group would need it rebuilt "
                          "as well); see docs/elastic.md")


def parse_elastic(text: str, start: int, *, unit: str = "replica", scale: int = 1) -> tuple[int, int]:
    """``--elastic MIN[:MAX]`` as (min, max) replicas; MAX defaults to the ``start`` count.

    ``unit``/``scale``: on a cluster the flag counts worker hosts (torchrun's ``--nnodes
    MIN:MAX``), each of ``scale`` replicas; ``start`` is in the same unit as the flag.
    """
    head, sep, tail = text.partition(":")
    try:
        low = int(head)
        high = int(tail) if sep else start
    except ValueError:
        raise ConfigError(f"--elastic: expected MIN or MIN:MAX ({unit}s, whole numbers). Received: {text!r}") from None
    if not 1 <= low <= start <= high:
        raise ConfigError(f"--elastic {text}: needs 1 <= MIN <= the {start} {unit}(s) the job starts with <= MAX")
    return low * scale, high * scale
