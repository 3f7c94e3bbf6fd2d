"""The model as the parameter-server strategy sees it: which shard lives where.

Workers and ps tasks build the same recipe model from the same seed and run
the same deterministic placement, so both sides know every shard's name, rows,
shape and dtype without sending any of it. That is what lets a message be bare
tensors: the order is the layout's order.

A *sparse* parameter is the weight of an ``nn.Embedding`` that placement split
by rows: workers pull and push only the rows a batch touches. Every other
shard is *dense*: pulled and pushed whole each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from distrun.strategies.ps.placement import ParamInfo, Placement, Shard, place

__all__ = ["Layout", "ShardRef", "pack", "flat_specs", "unpack_into"]


@dataclass(frozen=True)
class ShardRef:
    """One shard of parameter ``index`` (its place in ``model.parameters()``)."""

    shard: Shard
    index: int
    sparse: bool

    @property
    def name(self) -> str:
        return self.shard.name

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This shard's part of the whole parameter ``tensor`` (a view, not a copy)."""
        rows = self.shard.rows
        return tensor if rows is None else tensor[rows[0]: rows[1]]


class Layout:
    """Placement of one model's parameters on ``num_tasks`` ps tasks."""

    def __init__(self, model: nn.Module, num_tasks: int, partition_bytes: int,
                 rows_of: Callable[[nn.Module], bool] | None = None) -> None:
        """``rows_of``: which modules' partitioned ``weight`` is pulled and pushed by rows (default:
        a plain ``nn.Embedding``, what the parameter-server strategy's forward replaces; the
        hybrid's tables take ``nn.EmbeddingBag`` too)."""
        named = list(model.named_parameters())
        self.names = [name for name, _ in named]
        self.shapes = {name: tuple(p.shape) for name, p in named}
        self.dtypes = {name: p.dtype for name, p in named}
        self.num_tasks = num_tasks
        infos = [ParamInfo(name, tuple(p.shape), p.element_size()) for name, p in named]
        self.placement: Placement = place(infos, num_tasks, partition_bytes)
        embeddings = {f"{prefix}.weight" if prefix else "weight": module
                      for prefix, module in model.named_modules()
                      if (rows_of or _plain_embedding)(module)}
        self.sparse_names = frozenset(name for name in self.placement.partitioned if name in embeddings)
        index = {name: i for i, name in enumerate(self.names)}
        self.refs = tuple(ShardRef(shard, index[shard.name], shard.name in self.sparse_names)
                          for shard in self.placement.shards)

    def dense(self, task: int) -> list[ShardRef]:
        return [ref for ref in self.refs if ref.shard.task == task and not ref.sparse]

    def sparse(self, task: int) -> list[ShardRef]:
        return [ref for ref in self.refs if ref.shard.task == task and ref.sparse]

    def owned(self, task: int) -> list[ShardRef]:
        return [ref for ref in self.refs if ref.shard.task == task]

    def shards_of(self, name: str) -> list[ShardRef]:
        return [ref for ref in self.refs if ref.name == name]

    def shard_shape(self, ref: ShardRef) -> tuple[int, ...]:
        shape = self.shapes[ref.name]
        rows = ref.shard.rows
        return shape if rows is None else (rows[1] - rows[0], *shape[1:])

    def bytes_per_task(self) -> tuple[int, ...]:
        return self.placement.bytes_per_task

    def describe(self) -> list[str]:
        """One line per ps task: what it holds (printed at start: the placement, visible)."""
        lines = []
        for task in range(self.num_tasks):
            held = []
            for ref in self.owned(task):
                rows = ref.shard.rows
                held.append(ref.name if rows is None else f"{ref.name}[{rows[0]}:{rows[1]}]")
            mb = self.placement.bytes_per_task[task] / 2**20
            lines.append(f"ps{task}: {mb:.2f} MB, {len(held)} shard(s): {', '.join(held) or '-'}")
        return lines


def _plain_embedding(module: nn.Module) -> bool:
    return type(module) is nn.Embedding and module.max_norm is None and not module.sparse  # type: ignore[union-attr]


def pack(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One flat tensor per dtype, dtypes in order of first appearance (a message is few sends)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor.detach().reshape(-1))
    return [torch.cat(parts) if len(parts) > 1 else parts[0].clone() for parts in groups.values()]


def flat_specs(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> list[tuple[int, torch.dtype]]:
    """(numel, dtype) of each flat tensor ``pack`` makes from tensors of these shapes and dtypes."""
    sizes: dict[torch.dtype, int] = {}
    for shape, dtype in zip(shapes, dtypes):
        numel = 1
        for dim in shape:
            numel *= dim
        sizes[dtype] = sizes.get(dtype, 0) + numel
    return [(numel, dtype) for dtype, numel in sizes.items()]


def unpack_into(flats: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
    """Copy ``pack``'s output back into ``targets`` (same shapes and order as packed)."""
    offsets: dict[torch.dtype, int] = {}
    by_dtype = {flat.dtype: flat for flat in flats}
    for target in targets:
        flat = by_dtype[target.dtype]
        start = offsets.get(target.dtype, 0)
        target.copy_(flat[start: start + target.numel()].view_as(target))
        offsets[target.dtype] = start + target.numel()
