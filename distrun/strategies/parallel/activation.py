"""``--activation-checkpointing``: recompute each unit's activations in backward instead of keeping them.

A forward keeps what backward will need: for a transformer block, every intermediate of
attention and the MLP, times the batch. ``full`` keeps only each unit's input and runs the
unit's forward again during backward (about a third more compute, and the activation memory
of one unit at a time). ``selective`` keeps the outputs of the expensive ops (matmuls,
attention) and recomputes the cheap ones (elementwise ops, norms, softmax), torchtitan's
op-level selective checkpointing: most of the memory back for a few percent of compute.

The units are the ones sharded picks (the recipe's ``shard_units``, else the model's repeated
blocks), for every strategy. Each unit's ``forward`` is replaced on the instance by a
checkpointed call of the original, so parameter names stay as they were (``checkpoint_wrapper``
would add ``_checkpoint_wrapped_module.`` to each) and checkpoints move between jobs with and
without it. Hooks on the unit (FSDP2's gathers) run outside the checkpointed region, as with
torchtitan's wrapper. It never changes the parameters: recomputation repeats the same ops.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["checkpoint_units"]

#: Ops whose outputs selective checkpointing keeps: the compute-bound ones.
_KEEP = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten.convolution.default,
}


def checkpoint_units(units: Iterable[nn.Module], mode: str) -> int:
    """Checkpoint each unit's forward (``full`` or ``selective``); how many were wrapped."""
    if mode == "none":
        return 0
    count = 0
    for unit in units:
        # A method bound to the unit, calling its class's forward: a deep copy of the model
        # (central-storage's compute copy) binds it to the copy, not to this unit.
        unit.forward = types.MethodType(_checkpointed(mode), unit)
        count += 1
    return count


def _keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(mode: str) -> Callable[..., Any]:
    context = functools.partial(create_selective_checkpoint_contexts, _keep_expensive) if mode == "selective" else None

    def forward_checkpointed(unit: nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward = functools.partial(type(unit).forward, unit)
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for backward anyway
            return forward(*args, **kwargs)
        options: dict[str, Any] = {"use_reentrant": False}
        if context is not None:
            options["context_fn"] = context
        return checkpoint(forward, *args, **options, **kwargs)

    return forward_checkpointed
