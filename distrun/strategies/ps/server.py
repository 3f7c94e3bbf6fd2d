"""A ps task: holds its shards of the parameters and their optimizer state, applies pushes.

Each worker connection is served by its own thread (see ``ps.channel``); one
condition variable orders everything that reads or changes the shards, so an
update is applied whole, in the order pushes complete: asynchronous SGD, as in
TensorFlow's ParameterServerStrategy. Two options change when a reply goes out:

* ``sync`` (``--ps-sync``): a push waits until every connected worker has pushed
  once in this round; the mean of the round's gradients is applied once
  (SyncReplicasOptimizer). A worker that leaves or dies is dropped from the
  round, so the others never wait for it.
* ``max_staleness`` K (``--max-staleness``): a pull waits while the asking worker
  has pushed more than K times beyond the slowest connected worker (stale
  synchronous parallel). The bound holds from the first step: pulls wait until every
  expected worker has connected once (or the join grace is over), else a worker that
  starts late would begin far behind a fast one that ran alone. A worker that joins
  after that (a restart) starts level with the slowest.

``limit`` (sent with each push) is the step budget: updates beyond it are
refused, so ``--steps N`` means exactly N applied updates.

``elastic`` (``--embeddings ps --elastic``): rounds follow the replicas' membership, not the
connections. Each push names its membership round (a tag) and that round's size; a ps round is
whole when that many pushes of one tag are in. Whole, it is staged, and the pushers are told;
it is applied when a replica says that every ps task staged its part (``Op.DECIDE``), so a step
lands on every task or on none (a replica killed between two tasks' pushes leaves one task whole
and the other not). A round that cannot be whole any more is dropped, and its pushers told so:
when a connection that trained in its membership round is lost, or a replica of that round says
it left it (``Op.ABANDON``, as its recovery starts). The replicas then redo the whole step in
their next membership round, so no step is applied from some replicas' pushes, nor twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distrun.protocol import PsStats
from distrun.strategies.ps.channel import (
    Channel,
    Op,
    PeerRefused,
    accept_channel,
    check_header,
    describe_state,
    elastic_round,
    push_lr_factor,
    receive_state,
    watch_joins,
)
from distrun.strategies.ps.layout import Layout, flat_specs, pack, unpack_into

__all__ = ["ParameterServer", "serve_forever"]


class ParameterServer:
    def __init__(self, task: int, layout: Layout, model: nn.Module,
                 make_optimizer: Callable[[list[nn.Parameter]], Any], *, sync: bool = False,
                 max_staleness: int | None = None, wait_for_load: bool = False, expected_workers: int = 1,
                 join_grace_s: float = 60.0, wire: torch.dtype | None = None, rowwise: bool = False,
                 elastic: bool = False) -> None:
        """``expected_workers``, ``join_grace_s``: synchronous rounds start once every worker has
        connected, or after this grace (a worker that never comes must not stall the job).
        ``wire``: the dtype pushes and pulls cross in (``--compression fp16|bf16``).
        ``rowwise`` (``--embeddings ps``): a partitioned table's gradient is a sparse tensor of the
        rows pushed, so the optimizer touches only those rows (what ``nn.Embedding(sparse=True)``
        gives one-device training; SparseAdam needs it), not a dense one of zeros elsewhere.
        ``elastic``: synchronous rounds follow the replicas' membership rounds (the module's docstring)."""
        self.task = task
        self.wire = wire
        self._rowwise = rowwise
        if rowwise:  # ids are checked against the shard (``_local_rows``); say so, and torch stops warning
            torch.sparse.check_sparse_tensor_invariants.disable()
        self._refs = layout.owned(task)
        params = dict(model.named_parameters())
        self._tensors = [nn.Parameter(ref.view(params[ref.name].detach()).clone()) for ref in self._refs]
        self._dense = [i for i, ref in enumerate(self._refs) if not ref.sparse]
        self._sparse = [i for i, ref in enumerate(self._refs) if ref.sparse]
        self._dense_specs = flat_specs([tuple(self._tensors[i].shape) for i in self._dense],
                                       [self._tensors[i].dtype for i in self._dense])
        self._optimizer = make_optimizer(list(self._tensors)) if self._tensors else None
        #: The recipe's lr per group: a push is applied at these times its worker's lr factor.
        self._base_lrs = [group["lr"] for group in self._optimizer.param_groups] if self._optimizer else []
        self._sync = sync
        self._max_staleness = max_staleness
        self._cond = threading.Condition()
        self.applied = 0
        self._limit: int | None = None
        self._clocks: dict[int, int] = {}  # connected worker connection -> pushes counted for it
        self._workers: dict[int, int] = {}  # connection -> worker index
        #: connection -> (worker, grads, lr factor)
        self._round: dict[int, tuple[int, list[torch.Tensor | None], float]] = {}
        self._round_number = 0
        self._expected_workers = expected_workers
        self._joined: set[int] = set()  # worker indices that ever connected
        self._join_deadline = time.monotonic() + join_grace_s
        self._loaded = threading.Event()
        if not wait_for_load:
            self._loaded.set()
        self.finished = threading.Event()
        self._channels: list[Channel] = []
        self._elastic = elastic
        self._tag_of: dict[int, int] = {}  # connection -> the membership round tag it last trained in
        self._ended_tag = 0  # rounds of membership rounds up to this tag can never be whole
        self._round_tag = 0  # the membership round of the pushes in ``_round``
        self._round_members = 0  # how many pushes make it whole
        self._dropped: set[int] = set()  # round numbers dropped, not staged
        self._staged: tuple[int, list[torch.Tensor | None], float] | None = None  # (round number, mean, lr factor)

    # -- figures

    @property
    def done(self) -> bool:
        return self._limit is not None and self.applied >= self._limit

    def stats(self, rank: int) -> PsStats:
        """What this task holds and has done, as the live view's event (``rank``: this process's)."""
        with self._cond:
            return PsStats(rank=rank, time=time.time(), task=self.task, updates=self.applied,
                           bytes_in=sum(c.bytes_in for c in self._channels),
                           bytes_out=sum(c.bytes_out for c in self._channels),
                           params=sum(t.numel() for t in self._tensors), workers=len(self._clocks))

    def connected(self) -> int:
        with self._cond:
            return len(self._clocks)

    # -- one connection

    def serve(self, channel: Channel, connection: int, worker: int) -> str:
        """Answer one worker until it says BYE or its connection breaks; returns how it ended."""
        with self._cond:
            self._joined.add(worker)
            self._cond.notify_all()  # pulls held for the first worker set may go
            self._workers[connection] = worker
            self._channels.append(channel)
            self._clocks[connection] = min(self._clocks.values(), default=0)
        max_rows = max((self._tensors[i].shape[0] for i in self._sparse), default=0)
        lost = True  # unless it says BYE or FINISH
        try:
            while True:
                words = channel.recv_header()
                op, *args = check_header(words, chief=worker == 0, sparse_slots=len(self._sparse), max_rows=max_rows)
                if op in (Op.PUSH, Op.ROWS) and self._elastic:
                    tag, members = elastic_round(words)
                    if tag:
                        with self._cond:
                            self._tag_of[connection] = tag
                if op == Op.PULL:
                    self._pull(channel, connection)
                elif op == Op.PUSH:
                    self._push(channel, connection, pulled=args[0], limit=args[1], lr_factor=push_lr_factor(words),
                               members=members if self._elastic and tag else 0)
                elif op == Op.ROWS:
                    self._rows(channel, slot=args[0], count=args[1])
                elif op == Op.DECIDE:
                    self._decide(round_number=args[0], apply=bool(args[1]))
                elif op == Op.ABANDON:
                    with self._cond:
                        self._abandon(args[0])
                elif op == Op.STATE:
                    self._send_state(channel)
                elif op == Op.LOAD:
                    self._load_state(channel)
                elif op == Op.FINISH:  # the chief's last word
                    lost = False
                    self.finished.set()
                    channel.send_header(1)
                    return "finished the job"
                else:  # Op.BYE (check_header let no other op through)
                    lost = False
                    return "left"
        except PeerRefused as exc:  # it broke the wire's rules: the pair is dropped, the job goes on
            return f"refused ({exc})"
        except RuntimeError as exc:  # gloo: the peer closed the connection (died) or timed out
            return f"lost ({str(exc).splitlines()[0][:120]})"
        finally:
            with self._cond:
                self._clocks.pop(connection, None)
                tag = self._tag_of.pop(connection, 0)
                if lost and tag:  # --elastic: its membership round lost a replica, whose push may never come
                    self._abandon(tag)
                self._close_round_if_complete()
                self._cond.notify_all()

    def _reply_header(self, staleness: int = 0) -> list[int]:
        return [self.applied, int(self.done), staleness]

    def _pull(self, channel: Channel, connection: int) -> None:
        self._loaded.wait()
        with self._cond:
            flats = self._current_parameters(connection)
            header = self._reply_header()
        channel.send_header(*header)
        channel.send_values(*flats)

    def _current_parameters(self, connection: int) -> list[torch.Tensor]:
        """The dense shards, once this worker is within the staleness bound (lock held)."""
        if self._max_staleness is not None:
            while not self.done and (not self._all_joined() or self._ahead(connection) > self._max_staleness):
                self._cond.wait(0.5)
        return pack([self._tensors[i] for i in self._dense])

    def _all_joined(self) -> bool:
        """Every expected worker has connected once, or waiting for them is over (lock held)."""
        return len(self._joined) >= self._expected_workers or time.monotonic() >= self._join_deadline

    def _ahead(self, connection: int) -> int:
        return self._clocks.get(connection, 0) - min(self._clocks.values(), default=0)

    def _push(self, channel: Channel, connection: int, *, pulled: int, limit: int, lr_factor: float = 1.0,
              members: int = 0) -> None:
        flats = [channel.recv_values((numel,), dtype) for numel, dtype in self._dense_specs]
        grads: list[torch.Tensor | None] = [None] * len(self._tensors)
        dense = [torch.empty_like(self._tensors[i]) for i in self._dense]
        unpack_into(flats, dense)
        for i, grad in zip(self._dense, dense):
            grads[i] = grad
        for i in self._sparse:
            (count, *_rest) = channel.recv_header()
            shard = self._tensors[i]
            if not 0 <= count <= shard.shape[0]:
                raise PeerRefused(f"PUSH: {count} rows for a shard of {shard.shape[0]}")
            ids = self._local_rows(i, channel.recv((count,), torch.int64))
            rows = channel.recv_values((count, *shard.shape[1:]), shard.dtype)
            grads[i] = (torch.sparse_coo_tensor(ids.unsqueeze(0), rows, shard.shape, check_invariants=False)
                        if self._rowwise else torch.zeros_like(shard).index_add_(0, ids, rows))
        self._loaded.wait()
        if members:  # --elastic: a membership round's push
            with self._cond:
                self._clocks[connection] = self._clocks.get(connection, 0) + 1
                staged, number = self._elastic_push(connection, members, grads, lr_factor)
                flats = self._current_parameters(connection)
                header = [*self._reply_header(), 1 if staged else 2, number]
            channel.send_header(*header)
            channel.send_values(*flats)
            return
        with self._cond:
            if limit > 0:
                self._limit = limit
            staleness = 0
            if not self.done and connection in self._clocks:
                self._clocks[connection] += 1
                if self._sync:
                    self._round[connection] = (self._workers[connection], grads, lr_factor)
                    mine = self._round_number
                    self._close_round_if_complete()
                    while self._round_number == mine and not self.done:
                        self._cond.wait(0.5)
                        self._close_round_if_complete()  # the join grace may have run out
                else:
                    staleness = self.applied - pulled
                    self._apply(grads, lr_factor)
                    self._cond.notify_all()
            # The reply carries the parameters the worker's next step needs: no separate pull.
            flats = self._current_parameters(connection)
            header = self._reply_header(staleness)
        channel.send_header(*header)
        channel.send_values(*flats)

    def _close_round_if_complete(self) -> None:
        """Apply the round's mean once every connected worker is in it (call with the lock held).

        Summed in worker order, so a synchronous job is reproducible; not before every
        expected worker has connected once (or the join grace is over), so the first
        rounds are not the chief's alone.
        """
        if self._elastic or not self._sync or not self._round or not set(self._round) >= set(self._clocks):
            return  # --elastic: rounds are whole by count (``_elastic_push``)
        if not self._all_joined():
            return
        if not self.done:
            mean, lr_factor = self._mean()
            self._apply(mean, lr_factor)
        self._round = {}
        self._round_number += 1
        self._cond.notify_all()

    def _mean(self) -> tuple[list[torch.Tensor | None], float]:
        """The round's mean gradient, summed in worker order, and its lr factor (lock held)."""
        ordered = sorted(self._round.values(), key=lambda entry: entry[0])
        contributions = [grads for _worker, grads, _factor in ordered]
        mean: list[torch.Tensor | None] = []
        for i, tensor in enumerate(self._tensors):
            parts = [grads[i] for grads in contributions if grads[i] is not None]
            if parts and parts[0].is_sparse:  # rowwise: the rows of every push, summed where they meet
                mean.append(sum(parts[1:], parts[0]) / len(contributions))
                continue
            mean.append(torch.stack(parts).sum(0) / len(contributions) if parts else torch.zeros_like(tensor))
        return mean, ordered[0][2]  # the workers of a round are at the same step: the first's lr

    # -- --elastic: rounds that follow the replicas' membership (the module's docstring)

    def _elastic_push(self, connection: int, members: int, grads: list[torch.Tensor | None],
                      lr_factor: float) -> tuple[bool, int]:
        """Put a push in its round and wait until the round is staged or dropped (lock held):
        (staged, the round's number)."""
        tag = self._tag_of.get(connection, 0)
        if tag <= self._ended_tag or (self._round and tag < self._round_tag):
            return False, -1  # its membership round is over: its replicas redo the step in the next
        if self._round and tag > self._round_tag:
            self._drop_round()  # pushes of an older membership round: their replicas are recovering
        self._round_tag, self._round_members = tag, members
        self._round[connection] = (self._workers[connection], grads, lr_factor)
        mine = self._round_number
        if len(self._round) >= self._round_members:  # whole: every replica of the membership round pushed
            mean, factor = self._mean()
            self._staged = (mine, mean, factor)
            self._round = {}
            self._round_number += 1
            self._cond.notify_all()
        while self._round_number == mine:
            self._cond.wait(0.5)
        return mine not in self._dropped, mine

    def _drop_round(self) -> None:
        """The round in progress can never be whole: its pushers are told, nothing is applied (lock held)."""
        self._dropped.add(self._round_number)
        self._round = {}
        self._round_number += 1
        self._cond.notify_all()

    def _abandon(self, tag: int) -> None:
        """Membership round ``tag`` lost a replica: its round in progress, and any later push of it, can
        never be whole (lock held). A round already staged is left to its replicas' word."""
        self._ended_tag = max(self._ended_tag, tag)
        if self._round and self._round_tag <= self._ended_tag:
            self._drop_round()

    def _decide(self, *, round_number: int, apply: bool) -> None:
        """A replica's word on a staged round: every task staged its part (apply), or some task dropped
        its own (drop). The first word decides; every replica of the round says the same."""
        with self._cond:
            if self._staged is None or self._staged[0] != round_number:
                return  # decided already, on another replica's word
            _number, mean, lr_factor = self._staged
            self._staged = None
            if apply:
                self._apply(mean, lr_factor)
            self._cond.notify_all()

    def _apply(self, grads: list[torch.Tensor | None], lr_factor: float = 1.0) -> None:
        """One optimizer step with ``grads``, at the pushing worker's lr (its scheduler's factor)."""
        if self._optimizer is not None:
            for group, base in zip(self._optimizer.param_groups, self._base_lrs):
                group["lr"] = base * lr_factor
            for tensor, grad in zip(self._tensors, grads):
                tensor.grad = grad
            self._optimizer.step()
            for tensor in self._tensors:
                tensor.grad = None
        self.applied += 1

    def _rows(self, channel: Channel, *, slot: int, count: int) -> None:
        i = self._sparse[slot]
        ids = self._local_rows(i, channel.recv((count,), torch.int64))
        self._loaded.wait()
        with self._cond:
            rows = self._tensors[i].detach()[ids]
        channel.send_values(rows)

    def _local_rows(self, i: int, ids: torch.Tensor) -> torch.Tensor:
        """Global row ids of shard ``i`` as its own indices; ids outside the shard are refused."""
        start, end = self._refs[i].shard.rows  # type: ignore[misc]
        if ids.numel() and (int(ids.min()) < start or int(ids.max()) >= end):
            raise PeerRefused(f"rows outside {start}:{end} asked of {self._refs[i].name}")
        return ids - start

    # -- checkpoints: shards and optimizer state, described in JSON, sent as tensors

    def _send_state(self, channel: Channel) -> None:
        self._loaded.wait()
        with self._cond:
            shards, tensors = [], []
            for tensor in self._tensors:
                state = self._optimizer.state.get(tensor, {}) if self._optimizer is not None else {}
                described, state_tensors = describe_state(state)
                shards.append({"state": described})
                tensors += [tensor.detach().clone(), *(t.clone() for t in state_tensors)]  # sent after the lock
            doc = {"applied": self.applied, "shards": shards}
        channel.send_json(doc)
        channel.send(*tensors)

    def _load_state(self, channel: Channel) -> None:
        doc = channel.recv_json()
        if (not isinstance(doc, dict) or not isinstance(doc.get("applied"), int) or not isinstance(doc.get("shards"), list)
                or len(doc["shards"]) != len(self._tensors) or not all(isinstance(s, dict) for s in doc["shards"])):
            raise PeerRefused(f"LOAD: not a description of this task's {len(self._tensors)} shard(s)")
        with self._cond:
            for tensor, shard in zip(self._tensors, doc["shards"]):
                channel.recv_into(tensor.data)
                state = receive_state(channel, shard.get("state", {}))
                if self._optimizer is not None and state:
                    self._optimizer.state[tensor] = state
            self.applied = int(doc["applied"])
            self._loaded.set()
            self._cond.notify_all()
        channel.send_header(1)


def serve_forever(server: ParameterServer, store: Any, on_event: Callable[[str], None], secret: bytes,
                  linger_s: float = 120.0) -> None:
    """Accept workers (numbered through ``store``, the job's TCPStore; each proves ``secret``,
    the job's) until the chief says FINISH, then wait (bounded) for the rest to leave."""
    stopping = threading.Event()

    def handle(connection: int) -> None:
        try:
            channel, worker = accept_channel(store, connection, server.task, secret, server.wire)
        except PeerRefused as exc:
            on_event(f"refused connection {connection}: {exc}")
            return
        except RuntimeError as exc:
            on_event(f"connection {connection} never opened: {str(exc).splitlines()[0][:120]}")
            return
        on_event(f"worker {worker} joined")
        how = server.serve(channel, connection, worker)
        on_event(f"worker {worker} {how}")

    def on_join(connection: int) -> None:
        threading.Thread(target=handle, args=(connection,), name=f"ps-conn{connection}", daemon=True).start()

    watcher = threading.Thread(target=watch_joins, args=(store, on_join, stopping.is_set), name="ps-joins",
                               daemon=True)
    watcher.start()
    server.finished.wait()
    stopping.set()
    watcher.join()
    deadline = time.monotonic() + linger_s
    while server.connected() and time.monotonic() < deadline:
        time.sleep(0.05)
