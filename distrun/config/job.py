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
from typing import Any

from distrun.config._compression import DEFAULT_POWERSGD_WARMUP
from distrun.config._diloco import validate_diloco
from distrun.config._observe import check_profile, check_spec_trackers
from distrun.config._parallel import validate_parallel
from distrun.config._sections import (
    DEFAULT_KEEP_CHECKPOINTS,
    DEFAULT_PS_PARTITION_MB,
    SECTION_TYPES,
    CheckpointSection,
    CommunicationSection,
    DilocoSection,
    ObserveSection,
    ParallelSection,
    PrecisionSection,
    PsSection,
    ShardingSection,
    StrategyName,
    StrategySection,
    TrainingSection,
    flat_changes,
)
from distrun.config._suggest import did_you_mean
from distrun.errors import ConfigError

__all__ = ["StrategyName", "JobSpec", "evaluator_spec", "DEFAULT_CPU_REPLICAS", "DEFAULT_KEEP_CHECKPOINTS", "DEFAULT_PS_PARTITION_MB",
           "PRECISIONS", "COMPILE_MODES", "ALLREDUCE_ALGORITHMS"]

#: Replicas started on a machine without GPUs when --replicas is not given: two is
#: the smallest count that exercises the distributed path (documented in docs/cli.md).
DEFAULT_CPU_REPLICAS = 2
#: ``--precision``: fp32, or autocast to bf16 / fp16 around forward and loss (docs/precision.md).
PRECISIONS = ("fp32", "bf16", "fp16")
#: ``--allreduce``: DDP's flat ring, inside each host then across hosts, or whichever of the two
#: measures faster on the job's own buckets (docs/communication.md).
ALLREDUCE_ALGORITHMS = ("flat", "hierarchical", "auto")
#: ``--compile-mode``: torch.compile's own modes.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class JobSpec:
    """Everything a training process needs to know about the job it belongs to: the recipe, a
    section per section of a job file (``config/_sections.py``), and what no file section holds.

    Build one with ``JobSpec.of(recipe, **flat)`` and change one with ``spec.replace(**flat)``:
    both take `distrun train`'s flat names (``steps``, ``checkpoint_dir``), ``FLAT_FIELDS`` says
    where each lives (``spec.training.steps``, ``spec.checkpoint.dir``).
    """

    recipe: str
    strategy: StrategySection = field(default_factory=StrategySection)
    training: TrainingSection = field(default_factory=TrainingSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    communication: CommunicationSection = field(default_factory=CommunicationSection)
    diloco: DilocoSection = field(default_factory=DilocoSection)
    ps: PsSection = field(default_factory=PsSection)
    sharding: ShardingSection = field(default_factory=ShardingSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    observe: ObserveSection = field(default_factory=ObserveSection)
    extra_env: Mapping[str, str] = field(default_factory=dict)
    #: SIGUSR1 to a rank (Slurm's warning before a time limit or a preemption) asks the job to
    #: write a checkpoint at a step every replica agrees on, then stop (exit 75) to be requeued.
    preemptible: bool = False

    @classmethod
    def of(cls, recipe: str, **flat: Any) -> JobSpec:
        """A validated spec from flat names (``JobSpec.of("/r.py", strategy=..., steps=5)``);
        every other field at its default."""
        return cls(recipe=recipe, **flat_changes(_DEFAULT_SECTIONS, flat, _OWN, "JobSpec.of"))

    def replace(self, **flat: Any) -> JobSpec:
        """This spec with the fields ``flat`` names (flat names, as ``of`` takes) changed, validated again."""
        sections = {name: getattr(self, name) for name in SECTION_TYPES}
        return dataclasses.replace(self, **flat_changes(sections, flat, _OWN, "JobSpec.replace"))

    @property
    def trainer_ranks(self) -> int:
        """Ranks that train (every replica's), before any ps task."""
        return self.strategy.replicas * self.parallel.ranks_per_replica

    @property
    def mesh(self) -> dict[str, int]:
        """The job's degrees as the summary and the live view show them."""
        return {"dp": self.strategy.replicas, "tp": self.parallel.tp, "pp": self.parallel.pp}

    @property
    def layout(self) -> str:
        """The layout in one line, as the jobs list shows it: ``dp 2 x tp 2``, then what else shapes a
        step (``pp 2 (1f1b, 4 microbatches)``, ``accumulate 2``, ``activation checkpointing full``,
        ``offload cpu``, ``embeddings on 2 ps``; a parameter-server job's ``2 ps``)."""
        parallel = self.parallel
        parts = [" x ".join(f"{name} {size}" for name, size in self.mesh.items() if name == "dp" or size > 1)]
        if parallel.pp > 1:
            parts[0] += f" ({parallel.pp_schedule}, {parallel.pipeline_microbatches} microbatches)"
        if self.training.accumulate > 1:
            parts.append(f"accumulate {self.training.accumulate}")
        if parallel.activation_checkpointing != "none":
            parts.append(f"activation checkpointing {parallel.activation_checkpointing}")
        if self.sharding.offload != "none":
            parts.append(f"offload {self.sharding.offload}")
        if self.ps.tasks:
            parts.append(f"embeddings on {self.ps.tasks} ps" if self.strategy.embeddings == "ps" else f"{self.ps.tasks} ps")
        return " · ".join(parts)

    @property
    def world_size(self) -> int:
        """Processes in the job: the training ranks (workers), then the ps tasks."""
        return self.trainer_ranks + self.ps.tasks

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def per_replica_batch_size(self) -> int | None:
        if self.training.global_batch_size is None:
            return None
        return self.training.global_batch_size // self.strategy.replicas

    def to_json(self) -> str:
        """The nested form: each section a JSON object under its name."""
        data = dataclasses.asdict(self)
        data["strategy"]["name"] = self.strategy.name.value
        data["training"]["args"] = list(self.training.args)
        data["extra_env"] = dict(self.extra_env)
        data["observe"]["tracker_uris"] = dict(self.observe.tracker_uris)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        data: dict[str, Any] = json.loads(text)
        _refuse_unknown(data, {f.name for f in dataclasses.fields(cls)}, "")
        for name, kind in SECTION_TYPES.items():
            body = data.get(name, {})
            if not isinstance(body, dict):
                raise ConfigError(f"job spec: {name}: expected an object of its keys. Received: {body!r} "
                                  "(client and worker versions differ?)")
            _refuse_unknown(body, {f.name for f in dataclasses.fields(kind)}, f"{name}.")
            data[name] = kind(**{key: _from_json_value(name, key, value) for key, value in body.items()})
        return cls(**data)


#: The JobSpec's fields outside its sections (``of`` and ``replace`` take them by these names).
_OWN = ("recipe", "extra_env", "preemptible")
_DEFAULT_SECTIONS = {name: kind() for name, kind in SECTION_TYPES.items()}


def _from_json_value(section: str, key: str, value: Any) -> Any:
    """A section's value as JSON brings it, as the section holds it: the strategy's name parsed, and
    a tuple where JSON has a list (``training.args``, ``observe.trackers``, ``observe.profile_steps``)."""
    if (section, key) == ("strategy", "name"):
        return StrategyName.parse(value)
    return tuple(value) if isinstance(value, list) else value


def _refuse_unknown(data: Mapping[str, Any], known: set[str], prefix: str) -> None:
    unknown = sorted(f"{prefix}{key}" for key in set(data) - known)
    if unknown:
        raise ConfigError(f"job spec: unknown keys {unknown} (client and worker versions differ?)")


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{name}: expected a positive whole number. Received: {value!r}")


def _validate(spec: JobSpec) -> None:
    strategy, training, checkpoint, observe = spec.strategy, spec.training, spec.checkpoint, spec.observe
    if not isinstance(strategy.name, StrategyName):
        raise ConfigError(f"--strategy: expected a StrategyName. Received: {strategy.name!r}")
    if not os.path.isabs(spec.recipe):
        raise ConfigError(f"recipe path must be absolute inside a job spec. Received: {spec.recipe!r}")
    _positive("--replicas", strategy.replicas)
    _positive("--steps", training.steps)
    _positive("--epochs", training.epochs)
    _positive("--global-batch-size", training.global_batch_size)
    _positive("--checkpoint-every", checkpoint.every)
    _positive("--keep-checkpoints", checkpoint.keep)
    _positive("--eval-every", training.eval_every)
    _positive("--accumulate", training.accumulate)
    if training.data_workers < 0:
        raise ConfigError(f"--data-workers: expected 0 or more worker processes. Received: {training.data_workers}")
    if strategy.device not in ("cpu", "cuda"):
        raise ConfigError(f"device: expected 'cpu' or 'cuda'. Received: {strategy.device!r}")
    if training.steps is not None and training.epochs is not None:
        raise ConfigError("--steps and --epochs are exclusive: give one")
    if strategy.name is StrategyName.ONE_DEVICE and strategy.replicas != 1:
        raise ConfigError(
            f"--strategy one-device runs one replica. Received: --replicas {strategy.replicas}; "
            "use --strategy mirrored for more"
        )
    if training.global_batch_size is not None and training.global_batch_size % strategy.replicas:
        raise ConfigError(
            f"--global-batch-size {training.global_batch_size} is not divisible by {strategy.replicas} replicas; "
            f"choose a multiple of {strategy.replicas}"
        )
    if training.accumulate > 1 and strategy.name is StrategyName.PARAMETER_SERVER:
        raise ConfigError(f"--accumulate {training.accumulate}: parameter-server workers push each batch as it "
                          "comes (asynchronous); give a larger --global-batch-size instead")
    batch = training.global_batch_size
    if batch is not None and training.accumulate > 1 and batch % (strategy.replicas * training.accumulate):
        raise ConfigError(
            f"--accumulate {training.accumulate}: --global-batch-size {batch} does not split into "
            f"{strategy.replicas} replica(s) x {training.accumulate} micro-batches; choose a multiple of "
            f"{strategy.replicas * training.accumulate}"
        )
    if (checkpoint.resume or checkpoint.every) and not checkpoint.dir:
        flag = "--resume" if checkpoint.resume else "--checkpoint-every"
        raise ConfigError(f"{flag} needs --checkpoint-dir")
    _validate_embeddings(spec)
    _validate_ps(spec)
    _validate_step(spec)
    validate_diloco(spec)  # before the general checks: its refusals say what diloco does instead
    _validate_compression(spec)
    _validate_allreduce(spec)
    _validate_elastic(spec)
    _validate_sharded(spec)
    _validate_preemptible(spec)
    validate_parallel(spec)
    check_profile(observe.profile_steps, training.steps)
    check_spec_trackers(observe.trackers, observe.tracker_uris, log_checkpoint=observe.tracker_checkpoint,
                        checkpoint_dir=checkpoint.dir)
    if training.on_nonfinite not in ("stop", "skip", "warn"):
        raise ConfigError(f"--on-nonfinite: expected stop, skip or warn. Received: {training.on_nonfinite!r}"
                          f"{did_you_mean(str(training.on_nonfinite), ('stop', 'skip', 'warn'))}")
    if observe.log_interval_s < 0:
        raise ConfigError(f"log interval must be >= 0 s. Received: {observe.log_interval_s!r}")


#: ``--embeddings``: the tables in the model, or on the ps tasks (the hybrid, docs/strategies.md#hybrid).
EMBEDDINGS = ("dense", "ps")


def _validate_embeddings(spec: JobSpec) -> None:
    """``--embeddings ps``: under which strategy, with what; what it does not combine with yet, in one line."""
    strategy, ps = spec.strategy, spec.ps
    if strategy.embeddings not in EMBEDDINGS:
        raise ConfigError(f"--embeddings: expected dense or ps. Received: {strategy.embeddings!r}"
                          f"{did_you_mean(str(strategy.embeddings), EMBEDDINGS)}")
    if strategy.embeddings == "dense":
        return
    if strategy.name not in (StrategyName.MIRRORED, StrategyName.MULTI_WORKER):
        raise ConfigError(f"--embeddings ps: for --strategy mirrored or multi-worker (DDP's dense layers beside the "
                          f"ps tasks' tables). Received: --strategy {strategy.name.value}")
    if ps.tasks < 1:
        raise ConfigError("--embeddings ps needs ps tasks: give --ps-tasks N (a local job; on a cluster, each host "
                          "with role ps runs one)")
    blocked = [(flag, why) for flag, why, on in (
        ("--ps-sync", "its rounds are always synchronous", ps.sync),
        ("--max-staleness", "its rounds are synchronous: nothing is stale", ps.max_staleness is not None),
        ("--tp/--pp", "not supported yet", spec.parallel.ranks_per_replica > 1),
    ) if on]
    if blocked:
        raise ConfigError(f"{blocked[0][0]} with --embeddings ps: {blocked[0][1]}")
    if not ps.partition_mb > 0:
        raise ConfigError(f"--ps-partition-mb: expected a positive size. Received: {ps.partition_mb!r}")


def _validate_ps(spec: JobSpec) -> None:
    ps = spec.ps
    if spec.strategy.embeddings == "ps":
        return  # _validate_embeddings
    if spec.strategy.name is not StrategyName.PARAMETER_SERVER:
        used = [flag for flag, on in (("--ps-tasks", ps.tasks), ("--ps-sync", ps.sync),
                                      ("--max-staleness", ps.max_staleness is not None)) if on]
        if used:
            raise ConfigError(f"{used[0]} is for --strategy parameter-server. Received: --strategy "
                              f"{spec.strategy.name.value}")
        return
    if ps.tasks < 1:
        raise ConfigError(f"--strategy parameter-server needs at least one ps task. Received: {ps.tasks}")
    if ps.max_staleness is not None:
        if isinstance(ps.max_staleness, bool) or not isinstance(ps.max_staleness, int) or ps.max_staleness < 0:
            raise ConfigError(f"--max-staleness: expected 0 or more steps. Received: {ps.max_staleness!r}")
        if ps.sync:
            raise ConfigError("--max-staleness bounds asynchronous training; --ps-sync has no staleness: give one")
    if not ps.partition_mb > 0:
        raise ConfigError(f"--ps-partition-mb: expected a positive size. Received: {ps.partition_mb!r}")


def _validate_step(spec: JobSpec) -> None:
    precision = spec.precision
    if precision.name not in PRECISIONS:
        raise ConfigError(f"--precision: expected {', '.join(PRECISIONS)}. Received: {precision.name!r}"
                          f"{did_you_mean(str(precision.name), PRECISIONS)}")
    if precision.compile_mode not in COMPILE_MODES:
        raise ConfigError(f"--compile-mode: expected {', '.join(COMPILE_MODES)}. Received: {precision.compile_mode!r}"
                          f"{did_you_mean(str(precision.compile_mode), COMPILE_MODES)}")
    if precision.compile_mode != "default" and not precision.compile:
        raise ConfigError(f"--compile-mode {precision.compile_mode} needs --compile")
    if spec.training.clip_grad_norm is not None:
        value = spec.training.clip_grad_norm
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ConfigError(f"--clip-grad-norm: expected a positive norm. Received: {value!r}")
        if spec.strategy.name is StrategyName.PARAMETER_SERVER:
            raise ConfigError("--clip-grad-norm with --strategy parameter-server: the ps tasks step each push "
                              "alone, so no step sees the gradients' global norm; clip in the recipe's loss")
    if spec.strategy.name is StrategyName.PARAMETER_SERVER:
        if precision.compile:
            raise ConfigError("--compile: parameter-server workers pull parameters in forward hooks and swap "
                              "embedding forwards per batch, which torch.compile cannot trace; "
                              "use it with one-device, mirrored, multi-worker or central-storage")
        if precision.name == "fp16" and spec.ps.sync:
            raise ConfigError("--precision fp16 with --ps-sync: a worker that skips an overflowing step would "
                              "hold up the round; use --precision bf16, or fp16 without --ps-sync")


#: Strategies whose replicas all-reduce gradients through DDP, where a communication hook applies.
_COMPRESSIBLE = (StrategyName.MIRRORED, StrategyName.MULTI_WORKER)


def _validate_compression(spec: JobSpec) -> None:
    communication, name = spec.communication, spec.strategy.name
    compression = communication.compression_spec
    warmup = communication.powersgd_warmup
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 2:
        raise ConfigError(f"--powersgd-warmup: expected 2 or more steps (DDP rebuilds its buckets after the "
                          f"first). Received: {warmup!r}")
    if warmup != DEFAULT_POWERSGD_WARMUP and compression.kind != "powersgd":
        raise ConfigError("--powersgd-warmup is for --compression powersgd")
    if compression.active and name is StrategyName.PARAMETER_SERVER:
        if compression.kind == "powersgd":  # a low-rank sum needs every replica's gradient at once
            raise ConfigError("--compression powersgd: compresses gradients that replicas all-reduce (mirrored, "
                              "multi-worker); parameter-server pushes take --compression fp16|bf16")
        return
    if compression.active and name is StrategyName.SHARDED:
        raise ConfigError(f"--compression {compression} with --strategy sharded: FSDP reduce-scatters gradients in "
                          "its own collectives, where a DDP hook cannot go; --precision bf16 gathers parameters in "
                          "bf16 and reduces gradients in fp32")
    if compression.active and name not in _COMPRESSIBLE:
        raise ConfigError(f"--compression {compression}: applies where replicas exchange gradients (mirrored, "
                          f"multi-worker, parameter-server); --strategy {name.value} has no such exchange")


def _validate_allreduce(spec: JobSpec) -> None:
    allreduce, name = spec.communication.allreduce, spec.strategy.name
    if allreduce not in ALLREDUCE_ALGORITHMS:
        raise ConfigError(f"--allreduce: expected {', '.join(ALLREDUCE_ALGORITHMS)}. Received: {allreduce!r}"
                          f"{did_you_mean(str(allreduce), ALLREDUCE_ALGORITHMS)}")
    if allreduce == "flat":
        return
    if allreduce == "auto":  # mirrored and one-host runs are told "flat: one host" by the probe's rules
        if name not in _COMPRESSIBLE:
            raise ConfigError(f"--allreduce auto: chooses how replicas all-reduce gradients (mirrored, "
                              f"multi-worker); --strategy {name.value} has no such all-reduce")
        return
    if name is not StrategyName.MULTI_WORKER:
        raise ConfigError(f"--allreduce {allreduce}: arranges the all-reduce across hosts, for --strategy "
                          f"multi-worker on a cluster; --strategy {name.value} runs on one host")
    if spec.communication.compression_spec.kind == "powersgd":
        raise ConfigError("--allreduce hierarchical with --compression powersgd: PowerSGD runs its own "
                          "all-reduces; use --allreduce flat, or --compression fp16|bf16")


SHARD_WITHIN = ("auto", "all", "host")
OFFLOAD = ("none", "cpu")


def _validate_sharded(spec: JobSpec) -> None:
    """``--strategy sharded`` and its flags; what does not combine with it yet, in one line each."""
    sharding, asynchronous = spec.sharding, spec.checkpoint.asynchronous
    if sharding.within not in SHARD_WITHIN:
        raise ConfigError(f"--shard-within: expected {' or '.join(SHARD_WITHIN)}. Received: {sharding.within!r}")
    if sharding.offload not in OFFLOAD:
        raise ConfigError(f"--offload: expected {' or '.join(OFFLOAD)}. Received: {sharding.offload!r}")
    if spec.strategy.name is not StrategyName.SHARDED:
        used = [flag for flag, on in (("--shard-within", sharding.within != "auto"),
                                      ("--offload", sharding.offload != "none"),
                                      ("--no-reshard-after-forward", not sharding.reshard_after_forward),
                                      ("--async-checkpoint", asynchronous)) if on]
        if used:
            raise ConfigError(f"{used[0]} is for --strategy sharded. Received: --strategy {spec.strategy.name.value}")
        return
    refused = [(flag, why) for flag, why, on in (
        ("--sync-batch-norm", "sharded keeps no replica-wide BatchNorm statistics", spec.strategy.sync_batch_norm),
        ("--offload cpu", "it moves shards off a GPU into host memory, and a CPU job holds them there already",
         sharding.offload == "cpu" and spec.strategy.device != "cuda"),
    ) if on]
    if refused:
        raise ConfigError(f"{refused[0][0]} with --strategy sharded: {refused[0][1]}")
    if asynchronous and not spec.checkpoint.dir:
        raise ConfigError("--async-checkpoint needs --checkpoint-dir")


def _validate_preemptible(spec: JobSpec) -> None:
    """A job that checkpoints when told it will end: the checkpoint needs somewhere to go, and the
    replicas need to agree on a step (parameter-server workers never agree on one)."""
    if not spec.preemptible:
        return
    if not spec.checkpoint.dir:
        raise ConfigError("--requeue needs --checkpoint-dir (on storage every node shares): the job resumes from it")
    if spec.strategy.name is StrategyName.PARAMETER_SERVER or spec.strategy.elastic:
        what = "--elastic" if spec.strategy.elastic else "--strategy parameter-server"
        raise ConfigError(f"--requeue with {what}: its replicas never agree on one step to checkpoint at")


def _validate_elastic(spec: JobSpec) -> None:
    """``--elastic``: what membership changes can carry over today (docs/elastic.md says why)."""
    strategy, communication = spec.strategy, spec.communication
    if not strategy.elastic:
        if strategy.elastic_max:
            raise ConfigError(f"--elastic: MAX {strategy.elastic_max} without MIN")
        return
    if strategy.name not in (StrategyName.MIRRORED, StrategyName.MULTI_WORKER, StrategyName.DILOCO):
        raise ConfigError(f"--elastic: for --strategy mirrored, multi-worker or diloco (replicas that each hold "
                          f"the whole state). Received: --strategy {strategy.name.value}")
    if not 1 <= strategy.elastic_min <= strategy.replicas <= strategy.elastic_max:
        raise ConfigError(f"--elastic {strategy.elastic_min}:{strategy.elastic_max}: needs 1 <= MIN <= the "
                          f"{strategy.replicas} replica(s) the job starts with <= MAX")
    blocked = [flag for flag, used in (("--compile", spec.precision.compile),
                                       ("--compression powersgd", communication.compression_spec.kind == "powersgd"),
                                       (f"--allreduce {communication.allreduce}", communication.allreduce != "flat"))
               if used]
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


def evaluator_spec(spec: JobSpec) -> JobSpec:
    """The training job's spec for its evaluator host: one process, one device, no process group,
    whatever the job's layout. Every section that says how replicas train together goes back to
    its defaults (--tp/--pp, diloco's, the parameter server's, sharding's, the gradients'
    compression and all-reduce, checkpointing), so none is refused under one-device; what a step
    computes (data, precision) stays."""
    return dataclasses.replace(
        spec, strategy=StrategySection(name=StrategyName.ONE_DEVICE, device=spec.strategy.device),
        checkpoint=CheckpointSection(), communication=CommunicationSection(), diloco=DilocoSection(), ps=PsSection(),
        sharding=ShardingSection(), parallel=ParallelSection(), preemptible=False)
