"""Where parameters live under the parameter-server strategy (issue 5 groundwork).

Each parameter is placed whole on one ps task, biggest first, each on the task
holding the fewest bytes so far: the longest-processing-time greedy rule, which
is within 4/3 of the best possible balance. A parameter larger than
``partition_bytes`` (an embedding table, typically) is split by rows across
every ps task instead, TensorFlow's PartitionedVariable: each task holds a
contiguous row range, so a worker can pull and push only the rows a batch
touches. Pure arithmetic on names and shapes; no torch needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ParamInfo", "Shard", "Placement", "place"]


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    element_bytes: int = 4

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.element_bytes


@dataclass(frozen=True)
class Shard:
    """``name`` (or its rows ``rows[0]:rows[1]`` when partitioned) lives on ps task ``task``."""

    name: str
    task: int
    rows: tuple[int, int] | None
    nbytes: int


@dataclass(frozen=True)
class Placement:
    shards: tuple[Shard, ...]
    bytes_per_task: tuple[int, ...]

    def shards_of(self, name: str) -> tuple[Shard, ...]:
        return tuple(shard for shard in self.shards if shard.name == name)

    @property
    def partitioned(self) -> tuple[str, ...]:
        return tuple(sorted({shard.name for shard in self.shards if shard.rows is not None}))


def place(params: Sequence[ParamInfo], num_tasks: int, partition_bytes: int | None = None) -> Placement:
    if num_tasks < 1:
        raise ValueError(f"the parameter-server strategy needs at least one ps task. Received: {num_tasks}")
    names = [param.name for param in params]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    load = [0] * num_tasks
    shards: list[Shard] = []
    whole: list[ParamInfo] = []
    for param in params:
        if partition_bytes is not None and param.nbytes > partition_bytes and param.shape and param.shape[0] > 1:
            shards.extend(_partition(param, num_tasks, load))
        else:
            whole.append(param)
    # Biggest first, each to the least loaded task; ties go to the lowest task (deterministic).
    for param in sorted(whole, key=lambda p: (-p.nbytes, p.name)):
        task = min(range(num_tasks), key=lambda t: (load[t], t))
        load[task] += param.nbytes
        shards.append(Shard(param.name, task, None, param.nbytes))
    order = {name: index for index, name in enumerate(names)}
    shards.sort(key=lambda shard: (order[shard.name], shard.rows or (0, 0)))
    return Placement(tuple(shards), tuple(load))


def _partition(param: ParamInfo, num_tasks: int, load: list[int]) -> list[Shard]:
    rows = param.shape[0]
    parts = min(num_tasks, rows)
    row_bytes = param.nbytes // rows
    shards = []
    start = 0
    for part in range(parts):
        size = rows // parts + (1 if part < rows % parts else 0)
        nbytes = size * row_bytes
        load[part] += nbytes
        shards.append(Shard(param.name, part, (start, start + size), nbytes))
        start += size
    return shards
