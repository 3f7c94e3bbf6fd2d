"""``--tp`` and ``--activation-checkpointing``: which strategies take them, and what they refuse.

A replica may span several ranks (TensorFlow's logical devices per replica): ``--tp N`` splits
each layer over N ranks, so a job runs ``replicas x tp`` ranks, and ``--replicas`` stays the
data-parallel degree. Only the strategies whose replicas step in lockstep over one process
group take it: mirrored and multi-worker (replicated over the data-parallel ranks) and sharded
(sharded over them). Each refusal below says why in one line (docs/strategies.md#model-parallel).
"""

from __future__ import annotations

from typing import Any

from distrun.errors import ConfigError

__all__ = ["ACTIVATION_CHECKPOINTING", "MODEL_PARALLEL_STRATEGIES", "validate_parallel"]

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
}

#: Flags of DDP's all-reduce: under --tp the data-parallel dimension is FSDP2's (replicated for
#: mirrored), where DDP's hooks and SyncBatchNorm do not go.
_DDP_ONLY = (
    ("--compression", lambda spec: spec.compression_spec.active),
    ("--allreduce", lambda spec: spec.allreduce != "flat"),
    ("--sync-batch-norm", lambda spec: spec.sync_batch_norm),
)


def validate_parallel(spec: Any) -> None:
    """Refuse, in one line naming the flag, what ``--tp``/``--activation-checkpointing`` cannot do."""
    tp = spec.tp
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"--tp: expected a positive whole number of ranks. Received: {tp!r}")
    if spec.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ConfigError(f"--activation-checkpointing: expected {', '.join(ACTIVATION_CHECKPOINTING)}. "
                          f"Received: {spec.activation_checkpointing!r}")
    name = spec.strategy.value
    if spec.activation_checkpointing != "none" and name == "parameter-server":
        raise ConfigError("--activation-checkpointing with --strategy parameter-server: its workers pull parameters "
                          "in forward hooks, which a recomputed forward would run again; use a synchronous strategy")
    if tp == 1:
        return
    if name not in MODEL_PARALLEL_STRATEGIES:
        raise ConfigError(f"--tp with --strategy {name}: {_WHY_NOT[name]}")
    if spec.elastic:
        raise ConfigError("--tp with --elastic: a lost rank takes a piece of every layer of its replica with it, so "
                          "no replica could go on; run --tp without --elastic (with --max-restarts on a cluster)")
    for flag, used in _DDP_ONLY:
        if used(spec):
            raise ConfigError(f"{flag} with --tp: it configures DDP's gradient all-reduce, and under --tp the "
                              "replicas meet through FSDP2's collectives instead")
