"""Evaluation with sync-on-read metrics (torchmetrics).

torchmetrics keeps per-replica state (sums and counts) that ``compute()``
all-reduces over the default process group: metrics are accumulated locally at
no communication cost and reduced once, when read. That is exactly
TensorFlow's sync-on-read variables, from a well-kept library, so distrun uses
it rather than its own reducer. The eval set is split across replicas without
padding or duplicates, so the reduced figures are exact.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric, Metric

from distrun.runtime._move import batch_len, to_device
from distrun.strategies import Strategy
from distrun.strategies.data.plan import is_map_style


def evaluate(
    strategy: Strategy,
    dataset: Any,
    *,
    forward: Callable[[torch.nn.Module, Any], Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    metrics: dict[str, Metric],
    per_replica_batch_size: int,
) -> dict[str, float]:
    device = strategy.device
    mean_loss = MeanMetric().to(device)
    named = {name: m.to(device) for name, m in metrics.items()}
    for m in named.values():
        m.reset()
    extra = None
    if is_map_style(dataset):
        index, count = strategy.eval_shard
        indices = list(range(index, len(dataset), count))
        batches: Any = DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=per_replica_batch_size)
        # Agreed before the first forward: where a forward is a collective (sharded), a replica
        # still running its own batches would otherwise meet a peer that has moved on to agreeing.
        extra = strategy.eval_forwards_to_match(len(batches))
    else:
        batches = dataset
    updating = strategy.updates_metrics
    with strategy.evaluating() as model, torch.no_grad():
        was_training = model.training
        model.eval()
        forwards, last = 0, None
        for batch in batches:
            batch = to_device(batch, device)
            outputs = strategy.eval_outputs(model, forward, batch)
            forwards, last = forwards + 1, batch
            if outputs is None or not updating:  # another rank of the replica counts this batch
                continue
            n = batch_len(batch)
            mean_loss.update(loss_fn(outputs, batch).detach(), weight=n)
            target = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
            for m in named.values():
                m.update(outputs, target)
        if extra is None:  # an iterable: its length is known once it ran out
            extra = strategy.eval_forwards_to_match(forwards)
        if extra and last is None:  # this replica's share was empty: any sample makes a forward
            last = to_device(next(iter(DataLoader(torch.utils.data.Subset(dataset, [0]), batch_size=1))), device)
        for _ in range(extra):  # counted nowhere: they only keep a collective forward in step
            strategy.eval_outputs(model, forward, last)
        model.train(was_training)
    with warnings.catch_warnings():
        if not updating:  # a rank that counted nothing: its part of the sync is zeros, not a mistake
            warnings.filterwarnings("ignore", message=r".*compute.* method of metric .* was called before")
        result = {"loss": float(mean_loss.compute())}
        result.update({name: float(m.compute()) for name, m in named.items()})
    return result
