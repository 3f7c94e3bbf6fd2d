"""The sections of a JobSpec: one frozen value per section of a job file (``config/job_file.SECTIONS``).

A section's name is the file's, and so are its attributes, with three exceptions said where
they are: the file's ``checkpoint.async`` is ``asynchronous`` (``async`` is Python's keyword),
``strategy.elastic`` (``MIN:MAX``) is ``elastic_min``/``elastic_max``, and ``observe`` holds
what the CLI made of its flags (``tensorboard`` is ``tensorboard_dir``, ``profile`` is
``profile_steps`` and ``profile_dir``, ``tracker``/``tracker_uri`` are ``trackers``/
``tracker_uris``; ``hang_timeout_s`` is the client's, never the job's). The file's ``cluster``
section says where the job runs, not what it is: no JobSpec section holds it.

A section only holds values: the JobSpec validates them together (``config/job.py``), as one
section's rule often reads another's (``--ps-sync`` and ``--precision fp16``). ``FLAT_FIELDS``
maps the flat names (``distrun train``'s parameters, and the JobSpec's fields before it had
sections) to ``(section, attribute)``: ``JobSpec.of`` and ``JobSpec.replace`` take them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

from distrun.config._compression import DEFAULT_POWERSGD_WARMUP, Compression
from distrun.config._diloco import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, DEFAULT_SYNC_EVERY
from distrun.config._suggest import did_you_mean
from distrun.errors import ConfigError

__all__ = ["StrategyName", "StrategySection", "TrainingSection", "PrecisionSection", "CheckpointSection",
           "CommunicationSection", "DilocoSection", "PsSection", "ShardingSection", "ParallelSection",
           "ObserveSection", "SECTION_TYPES", "FLAT_FIELDS", "DEFAULT_KEEP_CHECKPOINTS", "DEFAULT_PS_PARTITION_MB",
           "flat_changes"]

DEFAULT_KEEP_CHECKPOINTS = 3
#: Parameters bigger than this are split by rows across the ps tasks (docs/parameter-server.md).
DEFAULT_PS_PARTITION_MB = 64.0


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
class StrategySection:
    """``strategy:``: which strategy, over how many replicas, on what device."""

    name: StrategyName = StrategyName.ONE_DEVICE
    replicas: int = 1
    device: str = "cpu"
    #: the file's ``elastic: MIN:MAX`` (0: not elastic): replicas may leave and join while at least
    #: MIN remain, up to MAX (counted in replicas; the CLI turns hosts into replicas).
    elastic_min: int = 0
    elastic_max: int = 0
    sync_batch_norm: bool = False
    #: ``--embeddings``: ``dense`` (the tables are parameters like any other, all-reduced with
    #: them) or ``ps`` (the hybrid: tables larger than ``--ps-partition-mb`` on the ps tasks).
    embeddings: str = "dense"
    #: ``--auto-approximate``: ``--strategy auto`` chose this layout with compression and diloco
    #: allowed (cli/_auto_race.py). The job file's key, and the record of how the layout was chosen:
    #: a spec's strategy is the chosen one, never ``auto``.
    auto_approximate: bool = False

    @property
    def elastic(self) -> bool:
        return self.elastic_min > 0


@dataclass(frozen=True)
class TrainingSection:
    """``training:``: how long, how big a batch, from what seed, and what a step does about its loss."""

    steps: int | None = None
    epochs: int | None = None
    global_batch_size: int | None = None
    seed: int = 0
    #: fit recipes: DataLoader worker processes per rank reading train_data (0: in the rank).
    data_workers: int = 0
    #: ``--accumulate N``: each replica's share of a global batch in N micro-batches, one forward and
    #: backward each, the gradients synchronised once and the optimizer stepped once per global batch.
    accumulate: int = 1
    #: ``--eval-every N``: fit recipes with ``eval_data`` evaluate every N steps (and always at the end).
    eval_every: int | None = None
    #: ``--clip-grad-norm MAX``: the gradients' global norm clipped to MAX before each step.
    clip_grad_norm: float | None = None
    #: a NaN or Inf loss: stop the job naming step and rank, skip the update everywhere, or warn.
    on_nonfinite: str = "stop"
    #: the recipe's own arguments (its sys.argv[1:]; the CLI's ``recipe_args``).
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class PrecisionSection:
    """``precision:``: a replica's step: autocast precision, and torch.compile of the prepared model."""

    name: str = "fp32"
    compile: bool = False
    compile_mode: str = "default"


@dataclass(frozen=True)
class CheckpointSection:
    """``checkpoint:``: where, how often, how many kept, and whether the job resumes from the newest."""

    dir: str | None = None
    every: int | None = None
    keep: int = DEFAULT_KEEP_CHECKPOINTS
    resume: bool = False
    #: the file's ``async`` (a Python keyword, so not an attribute name): sharded only, write each
    #: checkpoint in the background (DCP's ``async_save``): a step waits only while the shards are
    #: copied out of the model.
    asynchronous: bool = False


@dataclass(frozen=True)
class CommunicationSection:
    """``communication:``: gradient communication (mirrored, multi-worker)."""

    #: ``none|fp16|bf16|powersgd[:RANK]``, and PowerSGD's plain all-reduce steps before it starts.
    compression: str = "none"
    powersgd_warmup: int = DEFAULT_POWERSGD_WARMUP
    #: how gradients meet across hosts (multi-worker): DDP's flat ring, hierarchical, or auto.
    allreduce: str = "flat"

    @property
    def compression_spec(self) -> Compression:
        return Compression.parse(self.compression)


@dataclass(frozen=True)
class DilocoSection:
    """``diloco:`` (config/_diloco.py): inner steps between syncs, the outer optimizer (SGD,
    Nesterov unless momentum is 0), what pseudo-gradients cross the wire as, and the fragments
    streaming DiLoCo syncs one at a time."""

    sync_every: int = DEFAULT_SYNC_EVERY
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    sync_dtype: str = "fp32"
    fragments: int = 1


@dataclass(frozen=True)
class PsSection:
    """``ps:``, parameter-server only: ps tasks (the job runs ``replicas`` workers plus these),
    synchronous rounds, the staleness bound, and the size above which a parameter is split by
    rows across every ps task."""

    tasks: int = 0
    sync: bool = False
    max_staleness: int | None = None
    partition_mb: float = DEFAULT_PS_PARTITION_MB

    @property
    def partition_bytes(self) -> int:
        return int(self.partition_mb * 2**20)


@dataclass(frozen=True)
class ShardingSection:
    """``sharding:``, sharded only: shard over every rank or inside each host (HSDP); free each
    unit's gathered parameters after its forward (FSDP's reshard_after_forward); keep the shards
    and the optimizer's state in host memory (``cpu``: FSDP's CPUOffloadPolicy)."""

    within: str = "auto"
    reshard_after_forward: bool = True
    offload: str = "none"


@dataclass(frozen=True)
class ParallelSection:
    """``parallel:``: a replica split over several ranks (config/_parallel.py)."""

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
    #: ``--activation-checkpointing``: none | full | selective, on each block.
    activation_checkpointing: str = "none"

    @property
    def ranks_per_replica(self) -> int:
        """Ranks one replica spans: its tensor-parallel times its pipeline degree (1 without either)."""
        return self.tp * self.pp

    @property
    def pipeline_microbatches(self) -> int:
        """``--microbatches``, or its default: two per pipeline rank."""
        return self.microbatches or 2 * self.pp


@dataclass(frozen=True)
class ObserveSection:
    """``observe:``: what the job shows of itself besides the live view."""

    #: ``--tensorboard DIR``: rank 0 (and each ps task) write event files there; on a cluster the
    #: chief host's server points it at the job's folder, and the client brings them home.
    tensorboard_dir: str | None = None
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
    #: each replica's progress is sent at most this often (0: every step).
    log_interval_s: float = 0.25


#: The JobSpec's sections by attribute name, in the job file's order.
SECTION_TYPES: Mapping[str, type] = MappingProxyType({
    "strategy": StrategySection, "training": TrainingSection, "precision": PrecisionSection,
    "checkpoint": CheckpointSection, "communication": CommunicationSection, "diloco": DilocoSection,
    "ps": PsSection, "sharding": ShardingSection, "parallel": ParallelSection, "observe": ObserveSection,
})


#: The flat names (`distrun train`'s parameters, as the JobSpec's fields were named before it had
#: sections) that are not their attribute's own word; every other attribute is its own flat name.
_RENAMED: Mapping[str, tuple[str, str]] = {
    "strategy": ("strategy", "name"), "recipe_args": ("training", "args"), "precision": ("precision", "name"),
    "checkpoint_dir": ("checkpoint", "dir"), "checkpoint_every": ("checkpoint", "every"),
    "keep_checkpoints": ("checkpoint", "keep"), "async_checkpoint": ("checkpoint", "asynchronous"),
    "ps_tasks": ("ps", "tasks"), "ps_sync": ("ps", "sync"), "ps_partition_mb": ("ps", "partition_mb"),
    "shard_within": ("sharding", "within"),
}

#: Each flat name -> (section, attribute). The JobSpec's own fields (recipe, extra_env,
#: preemptible) are not here: they keep their names.
FLAT_FIELDS: Mapping[str, tuple[str, str]] = MappingProxyType({
    **{field.name: (section, field.name) for section, kind in SECTION_TYPES.items()
       for field in dataclasses.fields(kind) if (section, field.name) not in _RENAMED.values()},
    **_RENAMED,
})


def flat_changes(current: Mapping[str, Any], flat: Mapping[str, Any], own: tuple[str, ...],
                 caller: str) -> dict[str, Any]:
    """The JobSpec's keyword arguments after ``flat`` (flat names) is applied to ``current``
    (its sections by name): each changed section rebuilt, ``own`` names passed as they are.
    An unknown name is a TypeError, as a dataclass's constructor raises."""
    changes: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for name, value in flat.items():
        if name in own:
            out[name] = value
            continue
        place = FLAT_FIELDS.get(name)
        if place is None:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
        changes.setdefault(place[0], {})[place[1]] = value
    for section, values in changes.items():
        out[section] = dataclasses.replace(current[section], **values)
    return out
