"""``--strategy diloco`` and its flags: the defaults, and what each refuses in one line.

DiLoCo (Douillard et al., 2023) trades communication for a little optimisation quality: each
replica takes ``--sync-every`` H inner steps alone with the recipe's optimizer, then the
replicas average their pseudo-gradient (global weights minus their own) once, and an outer
optimizer (SGD with Nesterov momentum) applies it to the global weights. ``--fragments K`` is
streaming DiLoCo: the model's units sync a fragment at a time, staggered over the H steps, each
fragment's exchange overlapping the steps after it. docs/strategies.md#diloco says when it pays.
"""

from __future__ import annotations

from typing import Any

from distrun.config._suggest import did_you_mean
from distrun.errors import ConfigError

__all__ = ["DEFAULT_OUTER_LR", "DEFAULT_OUTER_MOMENTUM", "DEFAULT_SYNC_EVERY", "DILOCO_DEFAULTS", "SYNC_DTYPES",
           "diloco_flags_used", "validate_diloco"]

#: The paper's settings: H=100 inner steps between syncs (500 in its largest runs), an outer
#: SGD with lr 0.7 and Nesterov momentum 0.9.
DEFAULT_SYNC_EVERY = 100
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9
#: ``--sync-dtype``: what a pseudo-gradient crosses the wire as. int8 is scaled per tensor with
#: one scale every replica agrees on, its rounding error fed into the next sync.
SYNC_DTYPES = ("fp32", "bf16", "int8")
#: The diloco section of a JobSpec at its defaults, by flat name (``JobSpec.replace`` takes them):
#: what a spec that stops being diloco's takes (one replica runs as one-device; a cluster's
#: evaluator host runs one process).
DILOCO_DEFAULTS = {"sync_every": DEFAULT_SYNC_EVERY, "outer_lr": DEFAULT_OUTER_LR,
                   "outer_momentum": DEFAULT_OUTER_MOMENTUM, "sync_dtype": "fp32", "fragments": 1}


def diloco_flags_used(spec: Any) -> list[str]:
    """The diloco flags ``spec`` sets away from their defaults, by flag name."""
    diloco = spec.diloco
    return [flag for flag, used in (("--sync-every", diloco.sync_every != DEFAULT_SYNC_EVERY),
                                    ("--outer-lr", diloco.outer_lr != DEFAULT_OUTER_LR),
                                    ("--outer-momentum", diloco.outer_momentum != DEFAULT_OUTER_MOMENTUM),
                                    ("--sync-dtype", diloco.sync_dtype != "fp32"),
                                    ("--fragments", diloco.fragments != 1)) if used]


def validate_diloco(spec: Any) -> None:
    """Refuse, in one line naming the flag, what ``--strategy diloco``'s flags cannot do."""
    name, diloco = spec.strategy.name.value, spec.diloco
    if name != "diloco":
        used = diloco_flags_used(spec)
        if used:
            raise ConfigError(f"{used[0]} is for --strategy diloco. Received: --strategy {name}")
        return
    every = diloco.sync_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"--sync-every: expected a positive number of inner steps between syncs. Received: {every!r}")
    lr = diloco.outer_lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
        raise ConfigError(f"--outer-lr: expected a positive learning rate (the paper's is {DEFAULT_OUTER_LR}). "
                          f"Received: {lr!r}")
    momentum = diloco.outer_momentum
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ConfigError(f"--outer-momentum: expected 0 (plain SGD, Nesterov off) up to but not 1. "
                          f"Received: {momentum!r}")
    if diloco.sync_dtype not in SYNC_DTYPES:
        raise ConfigError(f"--sync-dtype: expected {', '.join(SYNC_DTYPES)}. Received: {diloco.sync_dtype!r}"
                          f"{did_you_mean(str(diloco.sync_dtype), SYNC_DTYPES)}")
    fragments = diloco.fragments
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ConfigError(f"--fragments: expected a positive number of fragments. Received: {fragments!r}")
    if fragments > every:
        raise ConfigError(f"--fragments {fragments}: each fragment syncs at its own step of the {every} between "
                          f"syncs (--sync-every), so at most {every} fragments")
    if spec.checkpoint.every and spec.checkpoint.every % every:
        raise ConfigError(f"--checkpoint-every {spec.checkpoint.every} with --strategy diloco: checkpoints are written "
                          f"at syncs (they hold the global weights); give a multiple of --sync-every {every}")
    refused = [(flag, why) for flag, why, on in (
        ("--compression", "diloco's replicas exchange no gradients; --sync-dtype bf16|int8 sets what its "
                          "pseudo-gradients cross the wire as", spec.communication.compression_spec.active),
        ("--allreduce", "diloco's sync is one exchange of the model every --sync-every steps, not DDP's",
         spec.communication.allreduce != "flat"),
        ("--sync-batch-norm", "a replica steps alone between syncs; BatchNorm statistics are averaged at each sync",
         spec.strategy.sync_batch_norm),
        ("--elastic", "with --fragments, a fragment's exchange would be in flight when the group changes; "
                      "membership changes at whole-model syncs (--fragments 1)",
         spec.strategy.elastic and fragments > 1),
    ) if on]
    if refused:
        raise ConfigError(f"{refused[0][0]} with --strategy diloco: {refused[0][1]}")
