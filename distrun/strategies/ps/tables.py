"""The hybrid's tables (``--embeddings ps``): which embeddings go to the ps tasks, the module that
stands in for each on a replica, and the replica's line to the rows.

Both ends choose the same tables from the same recipe model (built from the job's seed):
every ``nn.Embedding`` / ``nn.EmbeddingBag`` whose weight is larger than ``--ps-partition-mb``
and that renormalises no rows (``max_norm`` rewrites looked-up rows in place, which a pulled
copy cannot). ``Tables`` holds them alone, so the parameter server's ``Layout`` places only
them, every one split by rows across the ps tasks; the rest of the model stays with DDP.

A replica's step: each ``RemoteEmbedding`` pulls the rows its batch looks up (``ROWS``), the
backward leaves their gradients on those rows, and ``RowClient.push`` sends them to every ps
task in one synchronous round (``PUSH``; the reply comes when every replica's push is in and
the round's mean is applied). Nothing here knows about DDP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distrun.errors import CheckpointError
from distrun.strategies.ps.channel import Channel, Op, describe_state, lr_factor_word, receive_state
from distrun.strategies.ps.layout import Layout

__all__ = ["Tables", "RemoteEmbedding", "RowClient", "is_table", "table_paths", "rowwise_refusal"]


def is_table(module: nn.Module) -> bool:
    """An embedding the hybrid can serve by rows."""
    return type(module) in (nn.Embedding, nn.EmbeddingBag) and module.max_norm is None  # type: ignore[union-attr]


def table_paths(model: nn.Module, partition_bytes: int) -> list[str]:
    """Module paths of the tables that go to the ps tasks, in the model's order."""
    return [path for path, module in model.named_modules()
            if path and is_table(module) and module.weight.numel() * module.weight.element_size() > partition_bytes
            and module.weight.shape[0] > 1]


def _key(path: str) -> str:
    return path.replace(".", "/")  # a submodule's name may not hold a dot


class Tables(nn.Module):
    """The chosen tables of ``model`` alone (the same modules, not copies), each under its path
    with ``/`` for ``.``: what the layout places and the ps tasks hold."""

    def __init__(self, model: nn.Module, paths: list[str]) -> None:
        super().__init__()
        modules = dict(model.named_modules())
        for path in paths:
            self.add_module(_key(path), modules[path])

    @staticmethod
    def weight_name(path: str) -> str:
        """The layout's name of the table at ``path``."""
        return f"{_key(path)}.weight"


#: Optimizers that change only the rows a step looked up: for each, the hyperparameters that
#: would move other rows too (a row with no gradient must come out as it went in).
_ROWWISE: dict[str, tuple[str, ...]] = {"SGD": ("momentum", "weight_decay"), "Adagrad": ("weight_decay",),
                                        "SparseAdam": ()}


def rowwise_refusal(optimizer: Any, tables: list[nn.Parameter]) -> str | None:
    """Why ``optimizer`` cannot update the tables row by row (None: it can)."""
    kind = type(optimizer).__name__
    ours = {id(p) for p in tables}
    for group in getattr(optimizer, "param_groups", []):
        if not any(id(p) in ours for p in group["params"]):
            continue
        if kind not in _ROWWISE or type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
            return (f"--embeddings ps: the ps tasks update only the rows a step looked up, and {kind} keeps "
                    "state that moves every row; use SGD, Adagrad or SparseAdam for the recipe's optimizer")
        used = [name for name in _ROWWISE[kind] if group.get(name)]
        if used:
            return (f"--embeddings ps: the ps tasks update only the rows a step looked up, and {kind} with "
                    f"{used[0]}={group[used[0]]} would move the others too; set {used[0]}=0")
    return None


def join_row_shards(parts: dict[Any, list[tuple[int, torch.Tensor, dict[str, Any]]]]
                    ) -> tuple[dict[Any, torch.Tensor], dict[Any, dict[str, Any]]]:
    """Whole values and optimizer state from row shards (``key -> [(first row, value, state)]``, any
    order): row-shaped state (Adagrad's sum, Adam's moments) joined like the values, scalars once."""
    values: dict[Any, torch.Tensor] = {}
    states: dict[Any, dict[str, Any]] = {}
    for key, pieces in parts.items():
        pieces.sort(key=lambda piece: piece[0])
        values[key] = torch.cat([value for _, value, _ in pieces])
        first_value, first_state = pieces[0][1], pieces[0][2]
        whole = {}
        for name, item in first_state.items():
            rows = isinstance(item, torch.Tensor) and item.shape == first_value.shape
            whole[name] = torch.cat([state[name] for _, _, state in pieces]) if rows else item
        if whole:
            states[key] = whole
    return values, states


@torch.no_grad()
def send_row_gradients(layout: Any, channel: Any, task: int, touched: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Within a PUSH to ``task``: for each of its table shards, the ids and the gradients of the rows a
    step looked up there (``touched``: name, ids, the rows' tensor), none where it looked up none."""
    for ref in layout.sparse(task):
        lo, hi = ref.shard.rows
        ids, rows = [], []
        for name, uniq, values in touched:
            if name == ref.name and values.grad is not None:
                mask = (uniq >= lo) & (uniq < hi)
                ids.append(uniq[mask])
                rows.append(values.grad[mask])
        row_shape = layout.shapes[ref.name][1:]
        ids_t = torch.cat(ids).cpu() if ids else torch.zeros(0, dtype=torch.int64)
        rows_t = (torch.cat(rows).cpu() if rows else torch.zeros((0, *row_shape), dtype=layout.dtypes[ref.name]))
        channel.send_header(ids_t.numel())
        channel.send(ids_t)
        channel.send_values(rows_t)


@torch.no_grad()
def exchange_rows(layout: Any, channels: list[Any], name: str, uniq: torch.Tensor, tag: int = 0) -> torch.Tensor:
    """The rows ``uniq`` of table ``name`` (on the CPU), each asked of the ps task holding it: every
    task's ask is sent before any answer is read, so the tasks look up at once. Parameter-server's
    workers and the hybrid's replicas both pull this way. ``tag``: the asker's membership round
    (``--elastic``; ``channel.elastic_round``), 0 where there is none."""
    shape = layout.shapes[name]
    rows = torch.empty((uniq.numel(), *shape[1:]), dtype=layout.dtypes[name])
    cpu_ids = uniq.cpu()
    asks = []
    for ref in layout.shards_of(name):
        lo, hi = ref.shard.rows
        mask = (cpu_ids >= lo) & (cpu_ids < hi)
        wanted = cpu_ids[mask]
        channel = channels[ref.shard.task]
        channel.send_header(Op.ROWS, layout.sparse(ref.shard.task).index(ref), wanted.numel(), tag)
        channel.send(wanted)
        asks.append((channel, mask, wanted.numel()))
    for channel, mask, count in asks:
        rows[mask] = channel.recv_values((count, *shape[1:]), rows.dtype)
    return rows


class RowClient:
    """A replica's channels to the ps tasks, for the tables only; counts what crosses them."""

    def __init__(self, layout: Layout, channels: list[Channel], device: torch.device) -> None:
        self.layout = layout
        self.channels = channels
        self.device = device
        #: (layout name, unique row ids, the pulled rows whose .grad backward fills) of this step.
        self.touched: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.pushes = 0
        #: Bytes of rows pulled and row gradients pushed (ids and headers included; checkpoints' not).
        self.step_bytes = 0
        #: Of those, the rows' and their gradients' values alone, over the steps pushed: what a step's
        #: unique rows are worth at the wire's dtype (eval's pulls, which push nothing, left out).
        self.row_bytes = 0
        #: ``--elastic``: the membership round this replica trains in, as its generation + 1 (0: not
        #: elastic), and its replicas: what a ps task counts a whole round by (``channel.elastic_round``).
        self.round_tag = 0
        self.members = 0

    def _moved(self) -> int:
        return sum(channel.bytes_in + channel.bytes_out for channel in self.channels)

    @torch.no_grad()
    def pull(self, name: str, uniq: torch.Tensor) -> torch.Tensor:
        """The rows ``uniq`` of table ``name``, each from the ps task holding it."""
        before = self._moved()
        rows = exchange_rows(self.layout, self.channels, name, uniq, self.round_tag)
        self.step_bytes += self._moved() - before
        return rows.to(self.device)

    @torch.no_grad()
    def push(self, lr_factor: float = 1.0) -> None:
        """This step's row gradients to every ps task; returns once each has applied the round.

        ``--elastic``: each task answers once its round is staged (every replica of the membership
        round pushed) or dropped (one was lost); only where every task staged its part is the step
        applied, on this replica's word or another's (``Op.DECIDE``). Otherwise the staged parts are
        dropped too, and a plain ``RuntimeError`` says the step must be redone: the membership record
        shows a replica lost, so the fit loop takes it for a change of membership, as a failed
        collective, and the new group redoes the whole step (no replica stepped its dense part)."""
        touched, self.touched = self.touched, []
        for _name, _ids, rows in touched:
            size = self._wire_itemsize(rows.dtype)
            self.row_bytes += (rows.numel() + (rows.grad.numel() if rows.grad is not None else 0)) * size
        before = self._moved()
        for task, channel in enumerate(self.channels):  # no dense shards, no step budget
            channel.send_header(Op.PUSH, 0, 0, lr_factor_word(lr_factor), self.round_tag, self.members)
            send_row_gradients(self.layout, channel, task, touched)
        replies = [channel.recv_header() for channel in self.channels]  # (a dense reply would follow: none here)
        if self.round_tag:
            staged = all(reply[3] == 1 for reply in replies)
            for channel, reply in zip(self.channels, replies):
                if reply[3] == 1:
                    channel.send_header(Op.DECIDE, reply[4], int(staged))
            if not staged:
                self.step_bytes += self._moved() - before
                raise RuntimeError("a ps task dropped this step's round: a replica of membership round "
                                   f"{self.round_tag - 1} left it; the step is redone")
        self.pushes += 1
        self.step_bytes += self._moved() - before

    def abandon(self) -> None:
        """``--elastic``: this replica leaves its membership round (a recovery begins): a round of it
        that is not whole on some ps task can never be, and its pushers there are told so."""
        if not self.round_tag:
            return
        for channel in self.channels:
            try:
                channel.send_header(Op.ABANDON, self.round_tag)
            except RuntimeError:
                pass  # that ps task is gone

    def _wire_itemsize(self, dtype: torch.dtype) -> int:
        """Bytes a value of ``dtype`` crosses in (``--compression fp16|bf16`` narrows floating ones)."""
        wire = self.channels[0].wire if self.channels else None
        return (wire if wire is not None and dtype.is_floating_point else dtype).itemsize

    def gather(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """Every table whole, and its optimizer state, by layout name (the chief's: ``STATE``)."""
        parts: dict[str, list[tuple[int, torch.Tensor, dict[str, Any]]]] = {}
        for task, channel in enumerate(self.channels):
            channel.send_header(Op.STATE)
            doc = channel.recv_json()
            for ref, shard in zip(self.layout.owned(task), doc["shards"]):
                value = channel.recv(self.layout.shard_shape(ref), self.layout.dtypes[ref.name])
                state = receive_state(channel, shard["state"])
                parts.setdefault(ref.name, []).append(((ref.shard.rows or (0, 0))[0], value, state))
        return join_row_shards(parts)

    def load(self, step: int, values: dict[str, torch.Tensor], states: dict[str, dict[str, Any]]) -> None:
        """Every table (whole, by layout name) and its optimizer state to the ps tasks, each task its
        rows (the chief's: ``LOAD``); a state tensor shaped like the table is split with it."""
        missing = [name for name in self.layout.names if name not in values]
        if missing:
            raise CheckpointError(f"the checkpoint has no {missing[0].replace('/', '.')} for the ps tasks")
        for task, channel in enumerate(self.channels):
            shards, tensors = [], []
            for ref in self.layout.owned(task):
                table = values[ref.name].detach().cpu().to(self.layout.dtypes[ref.name])
                if tuple(table.shape) != self.layout.shapes[ref.name]:
                    raise CheckpointError(f"{ref.name.replace('/', '.')}: the checkpoint's table is "
                                          f"{tuple(table.shape)}, the model's {self.layout.shapes[ref.name]}")
                rows = {key: ref.view(value.cpu()) if isinstance(value, torch.Tensor) and value.shape == table.shape
                        else value for key, value in states.get(ref.name, {}).items()}
                described, state_tensors = describe_state(rows)
                shards.append({"state": described})
                tensors += [ref.view(table).contiguous(), *state_tensors]
            channel.send_header(Op.LOAD)
            channel.send_json({"applied": step, "shards": shards})
            channel.send(*tensors)
            channel.recv_header()

    def close(self, chief: bool) -> None:
        """The chief ends the job on every ps task; another replica just leaves."""
        op = Op.FINISH if chief else Op.BYE
        for channel in self.channels:
            try:
                channel.send_header(op)
                if op == Op.FINISH:
                    channel.recv_header()
            except RuntimeError:
                pass  # that ps task is gone already
        self.channels = []


class RemoteEmbedding(nn.Module):
    """Stands in for a table on a replica: the same forward, over the rows pulled for this batch.

    It holds no parameters, so DDP never sees the table; the pulled rows are a leaf that
    backward fills, and ``RowClient.push`` sends that gradient.
    """

    def __init__(self, table: nn.Embedding | nn.EmbeddingBag, name: str, client: RowClient) -> None:
        super().__init__()
        self.table_name = name
        self.bag = isinstance(table, nn.EmbeddingBag)
        self.num_embeddings, self.embedding_dim = table.num_embeddings, table.embedding_dim
        self.padding_idx = table.padding_idx
        self.scale_grad_by_freq = table.scale_grad_by_freq
        self.mode = getattr(table, "mode", "mean")
        self.include_last_offset = getattr(table, "include_last_offset", False)
        self._client = client

    @torch.compiler.disable  # --compile: the dense part compiles; this talks to the ps tasks, between its graphs
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        uniq, inverse = torch.unique(input.reshape(-1), return_inverse=True)
        if uniq.numel() and (int(uniq[0]) < 0 or int(uniq[-1]) >= self.num_embeddings):
            raise IndexError(f"{self.table_name}: index out of range in self (rows 0:{self.num_embeddings}). "
                             f"Received: {int(uniq[0])}..{int(uniq[-1])}")
        rows = self._client.pull(self.table_name, uniq)
        rows.requires_grad_(torch.is_grad_enabled())
        if rows.requires_grad:
            self._client.touched.append((self.table_name, uniq, rows))
        padding = None
        if self.padding_idx is not None:
            hit = (uniq == self.padding_idx).nonzero()
            padding = int(hit[0, 0]) if hit.numel() else None
        local = inverse.view(input.shape)
        if not self.bag:
            return F.embedding(local, rows, padding, None, 2.0, self.scale_grad_by_freq, False)
        return F.embedding_bag(local, rows, offsets, None, 2.0, self.scale_grad_by_freq, self.mode, False,
                               per_sample_weights, self.include_last_offset, padding)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, on the ps tasks as {self.table_name!r}"
