"""``--accumulate N``: a replica's batch in N micro-batches, the gradients synchronised once.

Each micro-batch's loss is weighted by its share of the replica's rows, so the sum of the N
backwards is the gradient of the whole batch: a sample weighs the same whether it came in the
first micro-batch or the last, an epoch's uneven last batch included. Every replica runs all N
micro-batches, so collectives that every forward makes (FSDP's all-gathers) match across
replicas: a micro-batch with no rows left (a short last batch) runs one row with weight 0, as
the data plan already pads an empty share.

Only the last backward synchronises: DDP's ``no_sync`` flag and FSDP2's
``set_requires_gradient_sync`` are turned off for the others, on whatever modules the strategy
wrapped (the model itself, a compiled model's inner module, each pipeline stage's blocks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["batch_rows", "gradient_sync", "split_batch"]


def batch_rows(batch: Any) -> int | None:
    """The leading dimension of the batch's first tensor (its rows), or None where it has none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, (tuple, list)):
        for item in batch:
            rows = batch_rows(item)
            if rows is not None:
                return rows
    if isinstance(batch, dict):
        for item in batch.values():
            rows = batch_rows(item)
            if rows is not None:
                return rows
    return None


def _take(batch: Any, rows: int, index: torch.Tensor) -> Any:
    """``batch`` with only the rows ``index`` names, in every tensor whose first dimension is ``rows``
    (anything else, a per-batch constant, travels whole)."""
    if isinstance(batch, torch.Tensor):
        return batch.index_select(0, index.to(batch.device)) if batch.dim() and batch.shape[0] == rows else batch
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple keeps its type
        return type(batch)(*(_take(item, rows, index) for item in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_take(item, rows, index) for item in batch)
    if isinstance(batch, dict):
        return {key: _take(item, rows, index) for key, item in batch.items()}
    return batch


def split_batch(batch: Any, parts: int) -> list[tuple[Any, float]]:
    """``parts`` micro-batches of ``batch``, each with its share of the rows (the shares sum to 1).

    The rows split as evenly as they go (``tensor_split``'s rule). A part left with no rows gets
    the first row with share 0: it runs, so every replica makes the same collectives, and it
    weighs nothing.
    """
    rows = batch_rows(batch)
    if rows is None:
        raise ValueError("--accumulate splits a batch by its rows: it holds no tensor with a first dimension")
    pieces = torch.arange(rows).tensor_split(parts)
    out: list[tuple[Any, float]] = []
    for piece in pieces:
        if piece.numel():
            out.append((_take(batch, rows, piece), piece.numel() / rows))
        else:
            out.append((_take(batch, rows, torch.zeros(1, dtype=torch.long)), 0.0))
    return out


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within: backward synchronises gradients only if ``enabled`` (DDP and FSDP2 modules of ``model``)."""
    if enabled:
        yield
        return
    # Imported here: FSDP2's module pulls in torch.distributed's tensor package.
    from torch.distributed.fsdp import FSDPModule

    ddps = [module for module in model.modules() if isinstance(module, DistributedDataParallel)]
    fsdps = [module for module in model.modules() if isinstance(module, FSDPModule)]
    before = [ddp.require_backward_grad_sync for ddp in ddps]
    for ddp in ddps:
        ddp.require_backward_grad_sync = False
    for module in fsdps:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for ddp, value in zip(ddps, before):
            ddp.require_backward_grad_sync = value
        for module in fsdps:
            module.set_requires_gradient_sync(True, recurse=False)
