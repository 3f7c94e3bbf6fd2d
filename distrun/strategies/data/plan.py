"""Same data under every strategy: one permutation per epoch, each global batch split.

With the same seed and global batch size, one-device, mirrored and
central-storage draw identical global batches in identical order. A global batch
of size g is split over N replicas as evenly as possible (the first g % N
replicas take one more sample). Each replica scales its mean loss by
``weight = local_n * N / g``; averaging gradients over N replicas then gives
exactly the gradient of the mean loss over the whole global batch, so the last,
partial batch needs neither dropping nor duplicated samples. A replica whose
share is empty (g < N) gets one padding sample with weight 0: it takes part in
the collectives, so nobody hangs, and contributes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

__all__ = ["Share", "GlobalBatchPlan", "DistributedDataset", "is_map_style"]


def is_map_style(dataset: Any) -> bool:
    """A torch map-style Dataset: distrun samples, shards and batches it.

    Anything else iterable (a list, a generator, the recipe's own DataLoader, an
    IterableDataset) is a sequence of per-replica batches, used as given. Duck
    typing is not enough: a list of batches also has ``__getitem__`` and ``__len__``.
    """
    return isinstance(dataset, Dataset) and not isinstance(dataset, IterableDataset) and isinstance(dataset, Sized)


@dataclass(frozen=True)
class Share:
    """One replica's part of one global batch."""

    indices: tuple[int, ...]
    global_size: int
    real: int

    @property
    def weight_factor(self) -> float:
        """local_n / g; multiplied by the replica count this is the loss weight."""
        return self.real / self.global_size


class GlobalBatchPlan:
    """Which sample indices each replica reads for every global batch of an epoch."""

    def __init__(self, num_samples: int, global_batch_size: int, num_replicas: int, seed: int, shuffle: bool = True):
        if num_samples < 1:
            raise ValueError("train_data is empty: a map-style dataset needs at least one sample")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.num_replicas = num_replicas
        self.seed = seed
        self.shuffle = shuffle

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.num_samples / self.global_batch_size)

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        # Drawn on the CPU, named explicitly: the same order whatever device trains, and
        # whatever default device a recipe may have set (torch.set_default_device).
        gen = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=gen, device="cpu").tolist()

    def share(self, order: list[int], batch: int, replica: int) -> Share:
        start = batch * self.global_batch_size
        members = order[start : start + self.global_batch_size]
        g, n = len(members), self.num_replicas
        base, extra = divmod(g, n)
        lo = replica * base + min(replica, extra)
        size = base + (1 if replica < extra else 0)
        if size == 0:
            return Share(indices=(members[0],), global_size=g, real=0)
        return Share(indices=tuple(members[lo : lo + size]), global_size=g, real=size)


class _ShareSampler:
    """A batch sampler for DataLoader that yields one replica's shares of an epoch."""

    def __init__(self, plan: GlobalBatchPlan, replica: int, epoch: int, start_batch: int, on_share: Callable[[Share], None]):
        self._plan, self._replica, self._epoch, self._start = plan, replica, epoch, start_batch
        self._on_share = on_share

    def __iter__(self) -> Iterator[list[int]]:
        order = self._plan.order(self._epoch)
        for b in range(self._start, self._plan.batches_per_epoch):
            share = self._plan.share(order, b, self._replica)
            self._on_share(share)
            yield list(share.indices)

    def __len__(self) -> int:
        return max(0, self._plan.batches_per_epoch - self._start)


class DistributedDataset:
    """What ``strategy.distribute_dataset`` returns: iterating it runs one epoch.

    Map-style datasets are read through a DataLoader whose batch sampler follows
    the GlobalBatchPlan. Iterables are used as given, one element per step; the
    epoch ends for everyone when any replica runs out (checked with a one-int
    all-reduce per step), so an uneven split never hangs a replica.
    """

    def __init__(
        self,
        dataset: Any,
        global_batch_size: int,
        *,
        num_replicas: int,
        replica_id: int,
        seed: int,
        on_batch: Callable[[int, float], None],
        any_exhausted: Callable[[bool], bool],
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        self._dataset = dataset
        self._num_replicas = num_replicas
        self._replica_id = replica_id
        self._on_batch = on_batch
        self._any_exhausted = any_exhausted
        self._collate_fn = collate_fn
        self._num_workers = num_workers
        self._pin_memory = pin_memory
        self.epoch = 0
        self.next_batch = 0
        self.plan = (
            GlobalBatchPlan(len(dataset), global_batch_size, num_replicas, seed, shuffle)
            if is_map_style(dataset)
            else None
        )

    def __len__(self) -> int:
        if self.plan is None:
            raise TypeError("an iterable train_data has no known length")
        return self.plan.batches_per_epoch

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, next batch); normalised so an epoch's end reads as the next epoch's start."""
        if self.plan is not None and self.next_batch >= self.plan.batches_per_epoch:
            return self.epoch + 1, 0
        return self.epoch, self.next_batch

    def seek(self, epoch: int, next_batch: int) -> None:
        self.epoch, self.next_batch = epoch, next_batch

    def reshard(self, num_replicas: int, replica_id: int, *, redo_last: bool) -> None:
        """Split the same global batches over a new replica count (elastic membership).

        The global batch size and the sample order stay; each global batch is divided
        over ``num_replicas`` as the plan divides it, uneven shares weighted as always.
        ``redo_last``: the last batch handed out was not committed (its step failed), so
        it is handed out again, split the new way. Iterate again after a reshard: an
        iterator made before it still splits the old way.
        """
        if self.plan is None:
            raise TypeError("an iterable train_data cannot be resplit: each replica reads its own stream")
        self._num_replicas, self._replica_id = num_replicas, replica_id
        self.plan = GlobalBatchPlan(self.plan.num_samples, self.plan.global_batch_size, num_replicas,
                                    self.plan.seed, self.plan.shuffle)
        if redo_last and self.next_batch > 0:
            self.next_batch -= 1

    def __iter__(self) -> Iterator[Any]:
        # A consumer may stop on an epoch's last batch (a step limit), leaving the
        # previous generator unfinished: that epoch is complete all the same.
        self.epoch, self.next_batch = self.position
        if self.plan is not None:
            yield from self._iter_map_style(self.plan)
        else:
            yield from self._iter_iterable()
        self.epoch += 1
        self.next_batch = 0

    def _iter_map_style(self, plan: GlobalBatchPlan) -> Iterator[Any]:
        pending: list[Share] = []
        sampler = _ShareSampler(plan, self._replica_id, self.epoch, self.next_batch, pending.append)
        kwargs: dict[str, Any] = {"batch_sampler": sampler, "num_workers": self._num_workers,
                                  "pin_memory": self._pin_memory}
        if self._collate_fn is not None:
            kwargs["collate_fn"] = self._collate_fn
        for batch in DataLoader(self._dataset, **kwargs):
            share = pending.pop(0)
            self._on_batch(share.real, share.weight_factor * self._num_replicas)
            self.next_batch += 1
            yield batch

    def _iter_iterable(self) -> Iterator[Any]:
        source: Iterable[Any] = self._dataset
        it = iter(source)
        skip = self.next_batch
        while True:
            try:
                item = next(it)
                have = True
            except StopIteration:
                have = False
            if self._any_exhausted(not have):
                return
            if skip > 0:  # resuming: replay the epoch up to the saved position
                skip -= 1
                continue
            self._on_batch(batch_len(item), 1.0)
            self.next_batch += 1
            yield item


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (1 if it has none).

    A tuple or list: its first element; a mapping (a Hugging Face batch): its first value.
    """
    if isinstance(batch, Mapping) and batch:
        batch = next(iter(batch.values()))
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return int(first.shape[0])
    return 1
