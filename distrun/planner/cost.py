"""The cost model: a rank's peak memory and a step's time for one layout, from measured inputs.

Pure arithmetic on three value objects, so tests call it directly and the CLI (which never
imports torch) can decide with it:

- :class:`ModelProfile`: what the probe measured on one device of the real hardware (the
  recipe's own model and optimizer: parameter, gradient and optimizer-state bytes; a sample's
  forward-and-backward time and the activation bytes it keeps, with and without checkpointing;
  the process's own footprint);
- :class:`Resources`: the ranks the job was given, each rank's memory budget, and the links;
- :class:`Layout`: one candidate, in the job file's keys.

Memory per rank (bytes):

- mirrored (DDP): footprint + parameters + gradients twice (``.grad`` and DDP's buckets) +
  optimizer state + a micro-batch's activations;
- sharded (FSDP2 over n ranks): footprint + (parameters + gradients + optimizer state) / n + the
  largest unit unsharded twice (the one computing and the one prefetched) and its gradient +
  activations; its step's cost beyond compute is the probe's own sharded step of the recipe's
  model less that step's compute, where the probe could shard over these ranks (else the
  collectives' rates, and on CPU the buffers its allocator maps afresh each step); HSDP (``sharded
  --shard-within host``, several hosts) the same over a host's r ranks, plus the all-reduce of a
  rank's 1/r of the gradients across hosts;
- ``--pp p``: each stage 1/p of the mirrored terms; a stage keeps up to ``min(p, m)``
  microbatches' activations in flight under 1F1B (all ``m`` under GPipe);
- full activation checkpointing keeps the units' inputs (measured) plus one unit's activations,
  recomputed in backward.

Step time: compute (a replica's samples times the measured per-sample time, divided over the
pipeline's stages, plus the recomputed forward under checkpointing), plus the communication
left exposed: a ring all-reduce moves ``2(n-1)/n`` of the gradient bytes; FSDP all-gathers the
parameters twice (forward, backward) and reduce-scatters the gradients once; a pipeline pays
its bubble ``(p-1)/(m+p-1)`` of the schedule and an activation hop per microbatch and boundary,
forward and backward, over the slowest link it crosses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUDGET_SHARE", "FRESH_PER_PARAMETER_BYTE", "MAPPED_AFRESH_FROM_BYTES", "Layout", "Link", "ModelProfile",
           "Prediction", "Resources", "fits", "predict"]

#: A layout whose predicted peak passes this share of the budget is out: the rest is headroom for
#: the allocator's fragmentation and what the model does not see (the issue's 90%).
BUDGET_SHARE = 0.9
#: What a sharded rank's step allocates in blocks of 1 MiB or more, per byte of the model's
#: parameters: its gathers' buffers (forward and backward), the unsharded gradients, the reduction's
#: buffers, the optimizer's temporaries. A sharded CPU rank maps every such block afresh
#: (strategies/sharding/allocator.py), and the probe times what that costs (``fresh_bytes_per_s``).
#: Counted with torch.profiler's memory events, one step each: 11.9 (the 17M-parameter MLP of
#: ``bench auto``, 2 ranks, 64 rows a rank), 12.9 (256 rows), 11.5 (the 34M one, 4 rows), 11.2
#: (the 17M one over 4 ranks).
FRESH_PER_PARAMETER_BYTE = 12.0
#: The smallest block such a rank maps afresh: strategies/sharding/allocator.py's threshold (this
#: module imports nothing, so the CLI can decide without torch; a test holds the two equal).
MAPPED_AFRESH_FROM_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelProfile:
    """What the probe measured, on one device, for the recipe's model and optimizer."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    #: the units sharded and checkpointing work on (``shard_units``, else the top-level children).
    units: int
    largest_unit_bytes: int
    #: forward + backward of one sample, with the threads a rank gets (seconds): the slope of two
    #: batch sizes' times; ``overhead_s`` is their intercept, what every forward and backward costs.
    compute_s_per_sample: float
    #: the forward alone, which full checkpointing runs again in backward (seconds a sample).
    forward_s_per_sample: float
    activation_bytes_per_sample: int
    checkpointed_activation_bytes_per_sample: int
    #: the process before the model: the interpreter, torch, the runtime (bytes).
    base_bytes: int
    #: ``pp_chain``'s length (0: the recipe cannot be pipelined), and the largest activation that
    #: crosses between two of its parts, a sample's (bytes).
    chain_parts: int = 0
    boundary_bytes_per_sample: int = 0
    device: str = "cpu"
    overhead_s: float = 0.0  # what every forward and backward costs beyond its samples (s)
    optimizer_s: float = 0.0  # the optimizer's step over the whole model (s)
    #: the recipe's model sharded over the probe's ranks (FSDP2, as sharded lays it out): one step of
    #: ``probe_rows`` samples, timed (0: not measured, one rank or none to shard over).
    sharded_step_s: float = 0.0
    probe_rows: int = 0
    #: ``--tp``: the degrees the model's plan takes (none: it cannot be split), the parameter bytes of
    #: the layers it splits, and what a sample's forward and backward all-reduce among the
    #: tensor-parallel ranks (bytes, and all-reduces a forward and backward, whatever the rows).
    tp_degrees: tuple[int, ...] = ()
    tp_split_bytes: int = 0
    tp_bytes_per_sample: int = 0
    tp_messages: int = 0
    #: ``--offload cpu``: the optimizer's step over the whole model on the host's CPU (seconds; measured
    #: on a GPU host only, over the largest unit's parameters copied to the CPU and scaled by bytes;
    #: 0: not measured, or the recipe's optimizer cannot step on a CPU, and --offload is no candidate).
    optimizer_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tp_degrees", tuple(self.tp_degrees))  # a list, after a JSON round trip


@dataclass(frozen=True)
class Link:
    """A link's measured rate (bytes/s) and one message's latency (s)."""

    bytes_per_s: float
    latency_s: float

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return nbytes / self.bytes_per_s + messages * self.latency_s


@dataclass(frozen=True)
class Resources:
    """What the job was given: its ranks over hosts, each rank's memory budget, and the links."""

    ranks: int
    hosts: int
    budget_bytes: int  # one rank's
    within_host: Link
    between_hosts: Link | None = None  # the slowest pair's; None on one host
    #: each layout's fixed costs, timed on a tiny model among the probe's ranks (planner/overheads.py):
    #: a DDP step, an FSDP2 unit's gathers and reduction, a pipeline microbatch's sends and Python.
    ddp_step_s: float = 0.0
    shard_unit_s: float = 0.0
    microbatch_s: float = 0.0
    #: distrun's fit loop a step on a one-layer model under mirrored (runtime/_loop_probe.py): the data
    #: plan, the strategy's bookkeeping and DDP's; every layout pays it less DDP's part, plus its own.
    loop_step_s: float = 0.0
    #: FSDP's all-gather and reduce-scatter rates (bytes/s of the ``(n-1)/n`` share each moves), timed
    #: on the same ranks; 0: as the link's.
    gather_bytes_per_s: float = 0.0
    scatter_bytes_per_s: float = 0.0
    #: ``--tp``'s fixed cost a pair of split layers a forward and backward (DTensor's dispatch and its
    #: collectives' calls), timed on a tiny column-then-row pair over two of the probe's ranks.
    tp_pair_s: float = 0.0
    #: ``--offload cpu``: a rank's share of the host's memory (its state lives there), and the rate a
    #: pinned copy crosses between host and GPU (bytes/s); 0: not measured (no GPU).
    host_budget_bytes: int = 0
    pcie_bytes_per_s: float = 0.0
    #: What memory mapped afresh costs a CPU rank beyond memory it holds, as a rate (bytes/s);
    #: 0: not measured (a GPU's probe, or a server from before it was).
    fresh_bytes_per_s: float = 0.0

    @property
    def ranks_per_host(self) -> int:
        return max(1, self.ranks // max(1, self.hosts))

    def slowest(self, group: int) -> Link:
        """The link a collective over ``group`` consecutive ranks is bound by."""
        if self.between_hosts is None or group <= self.ranks_per_host:
            return self.within_host
        return self.between_hosts


@dataclass(frozen=True)
class Layout:
    """One candidate, in the job file's sections' keys (so a chosen one can be pinned)."""

    strategy: str  # mirrored | multi-worker | sharded | diloco (--auto-approximate's only)
    replicas: int
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int = 0  # 0: --pp's default, the stage count
    activation_checkpointing: str = "none"
    accumulate: int = 1
    #: sharded: ``all`` shards over every rank; ``host`` is HSDP (shard inside each host, replicate
    #: across hosts). Pinned either way: ``--shard-within auto`` would choose by its own rule.
    shard_within: str = "all"
    #: ``--tp``: each replica's split layers over this many ranks of one host.
    tp: int = 1
    #: ``--offload cpu`` (sharded on GPUs): the shards and the optimizer's state in host memory.
    offload: bool = False
    #: ``--auto-approximate``'s layouts (planner/approximate.py), which change the arithmetic: DDP's
    #: gradients sent as ``--compression`` (bf16), or ``diloco`` syncing every ``sync_every`` steps.
    compression: str = "none"
    sync_every: int = 0

    @property
    def exact(self) -> bool:
        """Whether it ends with one-device's parameters (everything but compression and diloco)."""
        return self.compression == "none" and self.strategy != "diloco"

    @property
    def trusted(self) -> bool:
        """Whether the cost model may choose this layout on its word: not ``--tp`` nor ``--offload``,
        whose models are unchecked on a GPU (planner/choose.py); those are chosen on a trial's time."""
        return self.tp == 1 and not self.offload

    @property
    def kind(self) -> tuple[str, int, str, int, bool, str]:
        """What runs a step (strategy, pipeline depth, HSDP or not, tensor parallel, offload, compression):
        a layout's checkpointing and accumulation variants share it, and its trial speaks for them."""
        return (self.strategy, self.pp, self.shard_within if self.strategy == "sharded" else "", self.tp, self.offload,
                self.compression)

    def describe(self) -> str:
        """``sharded x2``, ``mirrored --pp 2 (1f1b, 4 microbatches)``, ``mirrored --tp 2``, ``... --accumulate 2``."""
        if self.tp > 1:
            text = f"{self.strategy} --tp {self.tp}" + (f" x{self.replicas}" if self.replicas > 1 else "")
        else:
            text = f"{self.strategy} x{self.replicas}" if self.pp == 1 else f"{self.strategy} --pp {self.pp} " \
                f"({self.pp_schedule}, {self.microbatches or self.pp} microbatches)" + (
                    f" x{self.replicas}" if self.replicas > 1 else "")
        if self.strategy == "sharded" and self.shard_within == "host":
            text += " --shard-within host"
        if self.offload:
            text += " --offload cpu"
        if self.strategy == "diloco":
            text += f" --sync-every {self.sync_every}"
        if self.compression != "none":
            text += f" --compression {self.compression}"
        if self.activation_checkpointing != "none":
            text += f" --activation-checkpointing {self.activation_checkpointing}"
        if self.accumulate > 1:
            text += f" --accumulate {self.accumulate}"
        return text

    def job_file(self) -> dict[str, dict[str, Any]]:
        """The job file's sections for this layout: ``strategy``, ``parallel``, ``training``."""
        parallel: dict[str, Any] = {"tp": self.tp, "pp": self.pp, "activation_checkpointing": self.activation_checkpointing}
        if self.pp > 1:
            parallel |= {"pp_schedule": self.pp_schedule, "microbatches": self.microbatches or self.pp}
        sections = {"strategy": {"name": self.strategy, "replicas": self.replicas}, "parallel": parallel,
                    "training": {"accumulate": self.accumulate}}
        if self.strategy == "sharded":
            sections["sharding"] = {"within": self.shard_within, "offload": "cpu" if self.offload else "none"}
        if self.compression != "none":
            sections["communication"] = {"compression": self.compression}
        if self.strategy == "diloco":
            sections["diloco"] = {"sync_every": self.sync_every}
        return sections

    def flags(self) -> dict[str, Any]:
        """The layout as ``distrun train``'s parameter names (what ``build_spec`` takes)."""
        flags = {"strategy": self.strategy, "replicas": self.replicas, "tp": self.tp, "pp": self.pp,
                 "pp_schedule": self.pp_schedule, "microbatches": self.microbatches if self.pp > 1 else 0,
                 "activation_checkpointing": self.activation_checkpointing, "accumulate": self.accumulate}
        if self.strategy == "sharded":
            flags["shard_within"] = self.shard_within
            flags["offload"] = "cpu" if self.offload else "none"
        if self.compression != "none":
            flags["compression"] = self.compression
        if self.strategy == "diloco":
            flags["sync_every"] = self.sync_every
        return flags


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted peak (bytes, the highest rank) and step time (s), with the parts that
    make them, so a runner-up can say why it lost."""

    layout: Layout
    peak_bytes: int
    step_s: float
    compute_s: float
    exposed_comm_s: float
    parts: dict[str, int] = field(default_factory=dict)  # memory: name -> bytes
    fixed_s: float = 0.0  # the loop's, DDP's, FSDP's units' and the pipeline's microbatches' own costs
    #: the step a short real run of this layout took (``--strategy auto``'s trials), where it was timed
    timed_step_s: float | None = None
    #: ``--offload cpu``: what the rank keeps in host memory (its shards and optimizer state; bytes)
    host_bytes: int = 0

    @property
    def expected_step_s(self) -> float:
        """What a step will take: the trial's time where there was one, else the model's."""
        return self.timed_step_s if self.timed_step_s is not None else self.step_s

    @property
    def comm_share(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s > 0 else 0.0


def _activations(profile: ModelProfile, samples: float, checkpointing: str) -> float:
    """Bytes a rank keeps for backward over ``samples`` samples of a forward."""
    if checkpointing == "full":  # the units' inputs, plus one unit's activations recomputed at a time
        return samples * (profile.checkpointed_activation_bytes_per_sample
                          + profile.activation_bytes_per_sample / max(1, profile.units))
    return samples * profile.activation_bytes_per_sample


def predict(profile: ModelProfile, resources: Resources, layout: Layout, global_batch: int) -> Prediction:
    """``layout``'s highest rank's peak memory and its step time, at ``global_batch`` samples a step."""
    replicas, pp = layout.replicas, layout.pp
    samples = global_batch / replicas  # a replica's share of a step
    micro = samples / layout.accumulate  # one forward's
    state = profile.parameter_bytes + profile.gradient_bytes + profile.optimizer_bytes
    recompute = profile.forward_s_per_sample if layout.activation_checkpointing == "full" else 0.0
    compute = (samples * (profile.compute_s_per_sample + recompute) + layout.accumulate * profile.overhead_s
               + profile.optimizer_s)
    parts: dict[str, float] = {"footprint": profile.base_bytes}
    comm = fixed = host = 0.0  # links' time; the layout's machinery's fixed costs; --offload's host bytes
    if pp > 1:
        m = layout.microbatches or pp
        in_flight = m if layout.pp_schedule == "gpipe" else min(pp, m)
        parts["state"] = (state + profile.gradient_bytes) / pp
        parts["activations"] = _activations(profile, micro / m, layout.activation_checkpointing) * in_flight / pp
        stage = resources.slowest(pp * replicas)  # stages sit on consecutive ranks
        bubble = (pp - 1) / (m + pp - 1)
        # Each microbatch pays the whole model's fixed part on a stage, not the stage's 1/p of it, as
        # the arithmetic would have it: measured (34M parameters, a batch of 8 on 2 CPU ranks; 2, 4, 8
        # microbatches ran 0.91, 1.13, 1.37 s a step), each further microbatch cost 0.11 s where the
        # probe's fixed part was 0.14 s. Charged 1/p of it, the model put them at 0.60, 0.71, 0.97.
        compute = ((samples * (profile.compute_s_per_sample + recompute) / pp
                    + m * layout.accumulate * profile.overhead_s) / (1 - bubble) + profile.optimizer_s / pp)
        hops = 2 * (pp - 1) * m * layout.accumulate
        comm += stage.seconds(2 * (pp - 1) * samples * profile.boundary_bytes_per_sample, hops)
        fixed += (m + pp - 1) * layout.accumulate * resources.microbatch_s
        if replicas > 1:  # each stage's gradients all-reduced over the replicas
            link = resources.slowest(replicas * pp)
            comm += link.seconds(2 * (replicas - 1) / replicas * profile.gradient_bytes / pp, 2 * (replicas - 1))
    elif layout.tp > 1:
        comm, fixed = _tensor_parallel(profile, resources, layout, samples, parts, state)
        compute = (samples * (profile.compute_s_per_sample + recompute) + layout.accumulate * profile.overhead_s
                   ) * _tp_share(profile, layout.tp) + profile.optimizer_s * _tp_share(profile, layout.tp)
    elif layout.strategy == "sharded" and layout.shard_within == "host" and resources.hosts > 1:
        # HSDP: FSDP inside each host (its r ranks share the state and gather over the host's link),
        # DDP across hosts on the r-th of the gradients each rank holds.
        r, h = resources.ranks_per_host, resources.hosts
        parts["state"] = state / r
        compute += profile.optimizer_s * (1 / r - 1)
        parts["gathered"] = 3 * profile.largest_unit_bytes
        parts["activations"] = _activations(profile, micro, layout.activation_checkpointing)
        share = (r - 1) / r
        gathers = 2 * layout.accumulate
        within = resources.within_host
        comm += (gathers * share * profile.parameter_bytes / (resources.gather_bytes_per_s or within.bytes_per_s)
                 + share * profile.gradient_bytes / (resources.scatter_bytes_per_s or within.bytes_per_s)
                 + (gathers + 1) * profile.units * (r - 1) * within.latency_s)
        between = resources.slowest(resources.ranks)
        comm += between.seconds(2 * (h - 1) / h * profile.gradient_bytes / r, 2 * (h - 1))
        fixed += (profile.units + 1) * layout.accumulate * resources.shard_unit_s
        fixed += _fresh_s(profile, resources, layout)
    elif layout.strategy == "sharded" and layout.offload:
        host = state / replicas
        comm, fixed, compute = _offloaded(profile, resources, layout, micro, parts, compute)
    elif layout.strategy == "sharded":
        n = replicas
        parts["state"] = state / n
        compute += profile.optimizer_s * (1 / n - 1)  # each rank steps its shard only
        parts["gathered"] = 3 * profile.largest_unit_bytes  # two units' parameters, one's gradient
        parts["activations"] = _activations(profile, micro, layout.activation_checkpointing)
        link = resources.slowest(n)
        if profile.sharded_step_s > 0 and n <= resources.ranks_per_host:  # measured on these ranks
            alone = (profile.probe_rows * profile.compute_s_per_sample + profile.overhead_s
                     + profile.optimizer_s / n)
            # Beyond compute, a measured step is two all-gathers and a reduce-scatter; the gathers
            # come again with each further micro-batch.
            fixed += max(0.0, profile.sharded_step_s - alone) * (2 * layout.accumulate + 1) / 3
        else:  # from the collectives' rates (and FSDP2's fixed cost a unit)
            gathers = 2 * layout.accumulate  # all-gathers in forward and backward, one reduce-scatter
            gather_rate = resources.gather_bytes_per_s if n <= resources.ranks_per_host and \
                resources.gather_bytes_per_s else link.bytes_per_s
            scatter_rate = resources.scatter_bytes_per_s if n <= resources.ranks_per_host and \
                resources.scatter_bytes_per_s else link.bytes_per_s
            share = (n - 1) / n
            comm += (gathers * share * profile.parameter_bytes / gather_rate
                     + share * profile.gradient_bytes / scatter_rate
                     + (gathers + 1) * profile.units * (n - 1) * link.latency_s)
            fixed += (profile.units + 1) * layout.accumulate * resources.shard_unit_s
            fixed += _fresh_s(profile, resources, layout)
    else:  # mirrored / multi-worker: DDP
        parts["state"] = state + profile.gradient_bytes  # .grad and DDP's buckets
        parts["activations"] = _activations(profile, micro, layout.activation_checkpointing)
        if replicas > 1:
            link = resources.slowest(replicas)
            # All exposed: on gloo the buckets' all-reduce hid little of it behind backward here.
            comm += link.seconds(2 * (replicas - 1) / replicas * profile.gradient_bytes, 2 * (replicas - 1))
            fixed += resources.ddp_step_s
    fixed += max(0.0, resources.loop_step_s - resources.ddp_step_s)  # the loop around any layout's step
    peak = int(sum(parts.values()))
    return Prediction(layout, peak, compute + comm + fixed, compute, comm, {k: int(v) for k, v in parts.items()},
                      fixed_s=fixed, host_bytes=int(host))


def _fresh_s(profile: ModelProfile, resources: Resources, layout: Layout) -> float:
    """A sharded CPU rank's step mapping its buffers afresh, where no sharded step of the model was
    timed (the probe's step carries it where one was): the gathers come again with each further
    micro-batch, as in the timed step's share above. Without it, the model put sharded x2 of the
    17M-parameter MLP under a memory cgroup at 1.09 s a step; it ran at 1.74-1.84 s. Over two
    namespace hosts of one rank (veth), sharded x2 of the 34M one read 1.08 s and ran at 2.13-2.17
    s (2.35 s with it), the 17M one 1.54 s against 1.87-1.90 s (2.38 s with it). The count is the
    parameters'; activations of a large batch add to it (12.9 at 256 rows a rank, 11.9 at 64)."""
    if (profile.device != "cpu" or resources.fresh_bytes_per_s <= 0
            or profile.largest_unit_bytes < MAPPED_AFRESH_FROM_BYTES):
        return 0.0  # a GPU's caching allocator; not measured; units whose buffers stay on the heap
    fresh = FRESH_PER_PARAMETER_BYTE * profile.parameter_bytes * (2 * layout.accumulate + 1) / 3
    return fresh / resources.fresh_bytes_per_s


def _tp_share(profile: ModelProfile, tp: int) -> float:
    """The share of the model (its bytes, and so its matrix products' work) a rank of ``tp`` keeps:
    its 1/tp of the split layers, and every other layer whole."""
    split = profile.tp_split_bytes / max(1, profile.parameter_bytes)
    return 1 - split + split / tp


def _tensor_parallel(profile: ModelProfile, resources: Resources, layout: Layout, samples: float,
                     parts: dict[str, float], state: float) -> tuple[float, float]:
    """``--tp t`` (a replica's split layers over t ranks of one host, FSDP2 over the replicas, as
    torchtitan lays it out): fills ``parts`` and returns (communication s, fixed s) a step.

    Memory: the rank's share of the state (its 1/t of the split layers' parameters, gradients and
    optimizer state, the rest whole), FSDP2's unit buffers on that share, and a micro-batch's
    activations taken whole (a row-wise layer's input and a column-wise layer's output are split,
    the rest is not: the whole is the bound). Time: the split layers' all-reduces of a sample's
    activations over the host's link, latency a message, DTensor's fixed cost a layer pair, FSDP2's
    a unit, and the replicas' all-reduce of a rank's gradients."""
    t, replicas = layout.tp, layout.replicas
    share = _tp_share(profile, t)
    micro = samples / layout.accumulate
    parts["state"] = state * share
    parts["gathered"] = 3 * profile.largest_unit_bytes * share
    parts["activations"] = _activations(profile, micro, layout.activation_checkpointing)
    link = resources.within_host  # a tensor-parallel group stays in one host
    ring = 2 * (t - 1) / t
    comm = samples * profile.tp_bytes_per_sample * ring / link.bytes_per_s \
        + layout.accumulate * profile.tp_messages * 2 * (t - 1) * link.latency_s
    fixed = layout.accumulate * (profile.tp_messages / 2 * resources.tp_pair_s
                                 + (profile.units + 1) * resources.shard_unit_s)
    if replicas > 1:  # each rank's gradients all-reduced over the replicas (its own slice of the split ones)
        across = resources.slowest(replicas * t)
        comm += across.seconds(2 * (replicas - 1) / replicas * profile.gradient_bytes * share, 2 * (replicas - 1))
    return comm, fixed


def _offloaded(profile: ModelProfile, resources: Resources, layout: Layout, micro: float,
               parts: dict[str, float], compute: float) -> tuple[float, float, float]:
    """``sharded --offload cpu`` over n ranks (FSDP2's CPUOffloadPolicy): fills ``parts`` (the GPU's:
    two units gathered and one's gradient, the activations, the gradient shard; the state is in host
    memory) and returns (communication s, fixed s, compute s) a step. Beyond sharded's collectives,
    each gather first copies the rank's shard of the parameters up (forward and backward, each
    micro-batch), each reduce-scatter's shard of the gradients comes down, and the optimizer steps
    the shard on the CPU."""
    n = layout.replicas
    parts["gathered"] = 3 * profile.largest_unit_bytes
    parts["activations"] = _activations(profile, micro, layout.activation_checkpointing)
    # The rank's gradient shard stays on the GPU through the backward: measured on an H200 (torch
    # 2.11, one rank), the peak was the rest plus about the whole gradient (+876 MB for 16 blocks of
    # width 1024, whose gradient is 809 MB; +471 MB for 8, 406 MB; the same at batch 4 and 16);
    # without it auto predicted 728 MB for 1,604. Over n ranks, 1/n of it: extrapolated, unmeasured.
    parts["gradients"] = profile.gradient_bytes / n
    link = resources.slowest(n)
    gathers = 2 * layout.accumulate
    share = (n - 1) / n
    comm = 0.0
    if n > 1:
        comm += (gathers * share * profile.parameter_bytes / (resources.gather_bytes_per_s or link.bytes_per_s)
                 + share * profile.gradient_bytes / (resources.scatter_bytes_per_s or link.bytes_per_s)
                 + (gathers + 1) * profile.units * (n - 1) * link.latency_s)
    pcie = resources.pcie_bytes_per_s or link.bytes_per_s
    comm += (gathers * profile.parameter_bytes + profile.gradient_bytes) / n / pcie
    compute += (profile.optimizer_cpu_s or profile.optimizer_s) / n - profile.optimizer_s  # the shard's, on the CPU
    fixed = (profile.units + 1) * layout.accumulate * resources.shard_unit_s
    return comm, fixed, compute


def fits(prediction: Prediction, resources: Resources) -> bool:
    """Within :data:`BUDGET_SHARE` of the rank's budget (and, offloaded, of its share of the host's memory)."""
    host_ok = not prediction.host_bytes or prediction.host_bytes <= BUDGET_SHARE * resources.host_budget_bytes
    return prediction.peak_bytes <= BUDGET_SHARE * resources.budget_bytes and host_ok
