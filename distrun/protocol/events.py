"""Events: what training processes report, as small frozen dataclasses.

Events travel as one JSON object per line (NDJSON) over a pipe from a training
process to its launcher, and from there to the client (``--json`` prints them
unchanged). JSON, never pickle: a reader can decode an event without executing
anything, and a client of another language can read the stream.

``type`` names the class; decoding rejects unknown types and unknown or missing
fields, so a corrupted line is an error, not a half-filled event.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from distrun.errors import DistrunError
from distrun.protocol.diagnosis import CollectiveRecord, RankStack

__all__ = [
    "Event",
    "Started",
    "Step",
    "Log",
    "Eval",
    "Checkpointed",
    "Output",
    "Failed",
    "Done",
    "Exited",
    "Heartbeat",
    "HEARTBEAT_INTERVAL_S",
    "Hung",
    "Diagnosed",
    "Profiled",
    "Straggler",
    "PsStats",
    "Compiled",
    "AllReduceChosen",
    "MembershipChanged",
    "Synced",
    "Workload",
    "PEER_LOST",
    "OOM_KILLED",
    "SERVER_RANK",
    "EVALUATOR_RANK",
    "EventDecodeError",
    "encode_event",
    "decode_event",
]

#: Failed.kind of an error raised because another rank vanished mid-collective. Such
#: failures are consequences: the launcher never reports one as the root cause while
#: a primary failure exists.
PEER_LOST = "peer-lost"

#: Failed.kind of a rank the kernel's out-of-memory killer killed (the launcher tells it from
#: other SIGKILLs by its cgroup's count: launch/_oom.py).
OOM_KILLED = "oom-killed"

#: ``rank`` of events that come from no training rank: a worker server's own notes, and
#: the evaluator task (which evaluates checkpoints beside the training, TensorFlow's role).
SERVER_RANK = -1
EVALUATOR_RANK = -2

#: Lines longer than this are not decoded (a runaway writer must not exhaust memory).
MAX_EVENT_BYTES = 1 << 20


class EventDecodeError(DistrunError, ValueError):
    """A line on an event channel is not a valid event (a ValueError too, for older callers)."""


@dataclass(frozen=True)
class Event:
    type: ClassVar[str] = "event"
    rank: int
    time: float


@dataclass(frozen=True)
class Started(Event):
    """A training process is up: its device and pid (for the live view)."""

    type: ClassVar[str] = "started"
    pid: int
    device: str
    world_size: int
    recipe_kind: str


@dataclass(frozen=True)
class Step(Event):
    """Training progress of one replica; throttled, always sent for the first and last step."""

    type: ClassVar[str] = "step"
    step: int
    epoch: int
    loss: float | None
    samples_per_s: float
    mem_mb: float
    total_steps: int | None = None
    #: parameter-server workers: this worker's own pushes so far, and how many updates
    #: other workers applied between its pull and its push (its gradient's staleness).
    pushes: int | None = None
    staleness: int | None = None
    #: GPU ranks with NVML (the ``gpu`` extra): the device's utilisation, in percent.
    gpu_util: float | None = None
    #: The rank's peak memory so far: CUDA's max allocated, else the process's peak RSS (VmHWM).
    peak_mem_mb: float | None = None
    #: Per step, over the steps since this rank's previous Step event: the wall time from the
    #: end of one step to the end of the next, and the part of it that was this rank's own work
    #: (the wall time less the time it waited for its peers' gradients or shards). Under a
    #: synchronous strategy every rank's step takes the same wall time; its compute time is what
    #: tells a slow rank from the ranks that wait for it (docs/debugging.md#slow-ranks).
    step_ms: float | None = None
    compute_ms: float | None = None
    #: The learning rate the newest step used (the first param group's; a recipe's scheduler moves
    #: it). None where unknown: a custom loop, a plain script, a JSON line from before it was sent.
    lr: float | None = None
    #: ``--embeddings ps``: this replica's mean bytes a step so far, of table rows pulled plus row
    #: gradients pushed (the ps tasks' traffic; ids and headers aside), and of dense gradients
    #: all-reduced by DDP. None under other strategies.
    embedding_bytes_per_step: float | None = None
    dense_grad_bytes_per_step: float | None = None


@dataclass(frozen=True)
class Log(Event):
    """Scalars a recipe logged with ``strategy.log(...)``."""

    type: ClassVar[str] = "log"
    step: int
    scalars: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Eval(Event):
    """Metrics on eval_data, reduced over all replicas (sent by the chief)."""

    type: ClassVar[str] = "eval"
    step: int
    epoch: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpointed(Event):
    type: ClassVar[str] = "checkpoint"
    step: int
    path: str
    #: How long training waited for it: the whole write, or with --async-checkpoint the copy
    #: of the shards out of the model.
    blocked_ms: float = 0.0


@dataclass(frozen=True)
class Resumed(Event):
    """``--resume``: the checkpoint training goes on from (the chief's), and the step it holds.
    ``past_end``: that step is already at or past the job's last step, so nothing will be trained."""

    type: ClassVar[str] = "resumed"
    step: int
    path: str
    past_end: bool = False


@dataclass(frozen=True)
class Output(Event):
    """A line the recipe printed; the launcher makes these from stdout and stderr."""

    type: ClassVar[str] = "output"
    stream: str
    line: str


@dataclass(frozen=True)
class Failed(Event):
    """A replica raised. ``file``/``line`` point into the recipe where possible."""

    type: ClassVar[str] = "error"
    kind: str
    message: str
    file: str | None = None
    line: int | None = None
    step: int | None = None
    traceback: str | None = None
    #: Outside a step: what the rank was doing ("building the model", "loading the data"); ``step`` is None then.
    during: str | None = None


@dataclass(frozen=True)
class Done(Event):
    """A replica finished training; the chief's figures make the job summary."""

    type: ClassVar[str] = "done"
    steps: int
    final_loss: float | None
    samples_per_s: float
    first_step_time: float | None
    peak_mem_mb: float | None = None  # as Step's, at the end
    #: What this rank's host sent on its network interfaces (loopback excluded) while the rank
    #: ran: every process's traffic there, the job's and anything else's; None where unknown.
    net_bytes_sent: int | None = None
    #: The run ended early because a recipe's callback on this rank said so: the callback's class
    #: and what it watched ("EarlyStopping: eval_loss did not improve ..."); the summary's ``reason``.
    reason: str | None = None


@dataclass(frozen=True)
class Exited(Event):
    """The launcher saw a training process end (returncode < 0: killed by that signal)."""

    type: ClassVar[str] = "exited"
    returncode: int


@dataclass(frozen=True)
class PsStats(Event):
    """About once a second from each ps task: what it holds and what it has done."""

    type: ClassVar[str] = "ps"
    task: int
    updates: int
    bytes_in: int
    bytes_out: int
    params: int
    workers: int


@dataclass(frozen=True)
class Compiled(Event):
    """``--compile``: what TorchDynamo did so far on this rank, sent when it changes.

    ``graphs`` compiled graphs, ``graph_breaks`` places it fell back to Python,
    ``recompiles`` graphs compiled after the first step (new shapes, guards that
    failed), ``compile_s`` seconds spent compiling, ``reasons`` the first break reasons.
    """

    type: ClassVar[str] = "compile"
    graphs: int
    graph_breaks: int
    recompiles: int
    compile_s: float
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "reasons", tuple(self.reasons))  # JSON brings a list


@dataclass(frozen=True)
class AllReduceChosen(Event):
    """``--allreduce auto``: what the chief kept for this job, and why (sent once, before step 1).

    ``flat_ms`` and ``hierarchical_ms`` are the probe's times for one pass over the job's
    own buckets (the slowest rank's); None where no probe was needed (NCCL, one host, ...).
    """

    type: ClassVar[str] = "allreduce"
    algorithm: str
    reason: str
    flat_ms: float | None = None
    hierarchical_ms: float | None = None


@dataclass(frozen=True)
class MembershipChanged(Event):
    """``--elastic``: the replicas formed a new group (sent by the new group's chief).

    ``step``: the committed step the new group went on from (the step after it is the
    one redone); ``left``/``joined``: replicas by launcher rank and host; ``recovery_s``:
    from the failure (or a joiner's switch) to the next committed step; ``steps_lost``:
    committed steps that some member of the old group had and the new group does not.
    """

    type: ClassVar[str] = "membership"
    generation: int
    step: int
    world_size: int
    left: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    recovery_s: float = 0.0
    steps_lost: int = 0  # committed steps the new group does not hold (0 by design)


@dataclass(frozen=True)
class Synced(Event):
    """``--strategy diloco``: a sync's global weights landed (sent by the chief, once per fragment sync).

    ``outer_step``: whole-model syncs so far (under ``--fragments``, syncs of the last fragment);
    ``bytes_sent``: what the chief sent for it (a ring's count for the wire's dtype);
    ``seconds``: from the exchange's start to its landing; ``blocked_s``: how much of that the
    step waited (the rest overlapped compute).
    """

    type: ClassVar[str] = "sync"
    step: int
    outer_step: int
    fragment: int
    fragments: int
    bytes_sent: int
    elements: int
    seconds: float
    blocked_s: float
    dtype: str


#: How often each training process sends a Heartbeat (the client's hang detection reads it too).
HEARTBEAT_INTERVAL_S = 2.0


@dataclass(frozen=True)
class Heartbeat(Event):
    """Every few seconds from each training process: alive, and where its main thread is.

    ``where`` is ``"collective"`` when the innermost Python frame is inside
    torch (a collective, backward, an optimizer step), else ``"recipe FILE:LINE"``
    or ``"distrun"``: what lets the client tell a hung rank from the ranks waiting
    for it.
    """

    type: ClassVar[str] = "heartbeat"
    where: str


@dataclass(frozen=True)
class Workload(Event):
    """What a sample is worth, from the chief once, when the recipe says (``tokens_per_sample``):
    the client turns samples/s into tokens/s and, with ``flops_per_token`` and the device's
    ``peak_flops`` (dense, at the job's precision; None off a known GPU), into MFU."""

    type: ClassVar[str] = "workload"
    tokens_per_sample: int
    flops_per_token: float | None = None
    peak_flops: float | None = None
    devices: int = 1


@dataclass(frozen=True)
class Profiled(Event):
    """``--profile``: this rank's torch.profiler trace of global steps ``start_step``..``end_step``
    is written (``path``, on the rank's host). ``end_step`` is lower than asked when the job ended
    inside the window."""

    type: ClassVar[str] = "profile"
    start_step: int
    end_step: int
    path: str


@dataclass(frozen=True)
class Straggler(Event):
    """Made by the client: ``rank``'s compute time per step has stayed above the threshold times
    the median of the other ranks' for ``intervals`` reporting intervals in a row.

    ``ratio`` is its compute time over that median; ``host`` where it runs (None: this machine).
    Sent once when a rank becomes slow, and once with ``recovered`` when it has stayed under
    the threshold as long.
    """

    type: ClassVar[str] = "straggler"
    host: str | None
    ratio: float
    compute_ms: float
    median_ms: float
    intervals: int
    recovered: bool = False


@dataclass(frozen=True)
class Hung(Event):
    """Made by the client, not a process: no rank has stepped for ``stalled_s``.

    ``rank`` is the rank the others wait for (-1 if it cannot be told), ``waiting``
    the ranks blocked in a collective.
    """

    type: ClassVar[str] = "hang"
    stalled_s: float
    where: str
    waiting: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "waiting", tuple(self.waiting))  # JSON brings a list


@dataclass(frozen=True)
class Diagnosed(Event):
    """Made by the client: every rank's stack and last collective, gathered from every host
    (``reason``: ``"hang"`` when ``--hang-timeout-s`` fired, ``"asked"`` for ``distrun stacks``).

    ``awaited`` names the collective most blocked ranks wait in (``"#5 gloo:all_reduce"``);
    ``missing`` the ranks that never entered it; ``dump_dir`` where the Flight Recorder dumps
    were brought (None: none was asked for).
    """

    type: ClassVar[str] = "diagnosis"
    reason: str
    stacks: tuple[RankStack, ...] = ()
    collectives: tuple[CollectiveRecord, ...] = ()
    awaited: str | None = None
    missing: tuple[int, ...] = ()
    dump_dir: str | None = None

    def __post_init__(self) -> None:  # JSON brings lists of dicts
        object.__setattr__(self, "stacks", tuple(RankStack.from_dict(s) for s in self.stacks))
        object.__setattr__(self, "collectives", tuple(CollectiveRecord.from_dict(c) for c in self.collectives))
        object.__setattr__(self, "missing", tuple(self.missing))


_TYPES: dict[str, type[Event]] = {
    cls.type: cls
    for cls in (Started, Step, Log, Eval, Checkpointed, Resumed, Output, Failed, Done, Exited, Heartbeat, Hung, Diagnosed, PsStats,
                Compiled, AllReduceChosen, MembershipChanged, Synced, Workload, Profiled, Straggler)
}


def encode_event(event: Event) -> bytes:
    """One JSON line, ``type`` first, terminated by a newline."""
    body = {"type": event.type, **dataclasses.asdict(event)}
    return (json.dumps(body, separators=(",", ":"), allow_nan=True) + "\n").encode()


def event_to_dict(event: Event) -> dict[str, Any]:
    return {"type": event.type, **dataclasses.asdict(event)}


def decode_event(line: bytes | str) -> Event:
    if len(line) > MAX_EVENT_BYTES:
        raise EventDecodeError(f"event line of {len(line)} bytes exceeds {MAX_EVENT_BYTES}")
    try:
        data = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EventDecodeError(f"not JSON: {exc}") from None
    except RecursionError:  # json's scanner recurses once per nesting level
        raise EventDecodeError("JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise EventDecodeError("an event must be a JSON object")
    kind = data.pop("type", None)
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise EventDecodeError(f"unknown event type {kind!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise EventDecodeError(f"{kind} event: unknown fields {sorted(unknown)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise EventDecodeError(f"{kind} event: {exc}") from None
