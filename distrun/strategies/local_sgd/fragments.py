"""Streaming DiLoCo's fragments: the model's parameters cut into K groups of whole units, and the
step at which each group syncs.

Fragments follow the model's units (the blocks sharded shards and activation checkpointing
recomputes: the recipe's ``shard_units``, else the repeated blocks found), cut into K
contiguous runs of about equal parameter count, so a fragment is a run of layers, as in the
paper. A parameter outside every unit (an embedding, a final norm, a head) goes with the
nearest unit before it, or with the first fragment. Fragment k syncs every H steps, at step
offset ``(k + 1) H / K``: the syncs are spread evenly over the H steps, and the last fragment
syncs where plain DiLoCo would.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from distrun.errors import ConfigError

__all__ = ["Fragments", "split_fragments"]


class Fragments:
    """``indices[k]``: the positions (in ``model.parameters()`` order) of fragment k's tensors."""

    def __init__(self, indices: list[list[int]], sync_every: int) -> None:
        self.indices = indices
        self.sync_every = sync_every
        count = len(indices)
        self._offsets = [((k + 1) * sync_every // count) % sync_every for k in range(count)]

    def __len__(self) -> int:
        return len(self.indices)

    def due(self, step: int) -> list[int]:
        """The fragments whose sync falls on ``step`` (counted from 1), in order."""
        return [k for k, offset in enumerate(self._offsets) if step % self.sync_every == offset]


def split_fragments(model: nn.Module, units: Sequence[nn.Module], count: int, sync_every: int) -> Fragments:
    """Cut ``model``'s parameters into ``count`` fragments of whole units (see the module's docstring)."""
    params = list(model.parameters())
    if count == 1:
        return Fragments([list(range(len(params)))], sync_every)
    if count > len(units):
        what = f"{len(units)} unit(s)" if units else "no repeated blocks (define shard_units(model))"
        raise ConfigError(f"--fragments {count}: the model has {what} to split into fragments; "
                          f"give at most {max(len(units), 1)}")
    position = {id(p): i for i, p in enumerate(params)}
    unit_of: dict[int, int] = {}
    sizes = []
    for u, unit in enumerate(units):
        size = 0
        for p in unit.parameters():
            if id(p) in position and id(p) not in unit_of:
                unit_of[id(p)] = u
                size += p.numel()
        sizes.append(size)
    # Contiguous runs of units of about equal size: unit u opens the fragment its running total
    # reaches, never skipping one, and leaving enough units for the fragments still to open.
    total, running, cuts, previous = sum(sizes) or 1, 0, [], -1
    for u, size in enumerate(sizes):
        wanted = max(running * count // total, previous, count - (len(sizes) - u))
        previous = min(wanted, previous + 1, count - 1)
        cuts.append(previous)
        running += size
    indices: list[list[int]] = [[] for _ in range(count)]
    current = 0
    for p in params:
        if id(p) in unit_of:
            current = cuts[unit_of[id(p)]]
        indices[current].append(position[id(p)])
    return Fragments(indices, sync_every)

