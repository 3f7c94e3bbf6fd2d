"""One worker's line to one ps task: a two-member gloo process group.

Why not one process group for the whole job: a collective group is only as
alive as its least alive member, and the point of the parameter-server
strategy is that a worker may die (or come back) while the others train. So
each worker, on start, opens a separate two-member ``ProcessGroupGloo`` with
every ps task (c10d point-to-point: ``send``/``recv``), named by a connection
number it draws from the job's TCPStore. A dead worker breaks only its own
pairs ("connection closed by peer" on the ps side); a new worker draws a new
number and the ps accepts it. torch.distributed.rpc was the other candidate,
but its dynamic membership calls every member on join, so one dead worker
would stop any other from joining.

Messages are a fixed header (8 int64) followed by tensors whose shapes both
sides know from the placement, or by a JSON document sent as a uint8 tensor.
Tensors are data; nothing on this channel is unpickled.

``--compression fp16|bf16``: both ends agree on a wire dtype, and the values of a
step (gradients pushed, parameters and rows pulled) cross in it through
``send_values``/``recv_values``; the ps keeps and updates fp32. Checkpoint state
(STATE, LOAD) always crosses exact.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Channel", "Op", "HEADER_LEN", "open_worker_channels", "accept_channel", "watch_joins",
           "describe_state", "receive_state"]

HEADER_LEN = 8
_FP16_MAX = 65504.0
#: How long one send or receive may wait: long, because a ps answers a worker only when
#: its staleness bound or synchronous round allows; a peer that dies closes the socket
#: and ends the wait at once, so this only bounds a peer that hangs while alive.
_OP_TIMEOUT = timedelta(hours=1)
#: How long opening a pair may take (both ends connect at once; a worker that died
#: between drawing its number and connecting must not hold a ps thread for an hour).
_CONNECT_TIMEOUT = timedelta(seconds=60)
_JOINS_KEY = "ps/joins"
_POLL_S = 0.02


class Op:
    """Header word 0: what a worker asks of a ps task."""

    PULL = 1  # dense parameters and the version they are at
    PUSH = 2  # gradients (dense, then touched rows of partitioned embeddings); the reply is a PULL's
    ROWS = 3  # rows of a partitioned embedding
    STATE = 4  # everything, for a checkpoint
    LOAD = 5  # everything, from a checkpoint
    FINISH = 6  # the chief: the job is over
    BYE = 7  # a worker leaves


class Channel:
    """Blocking, ordered exchange with one peer; ``bytes_in``/``bytes_out`` count payload."""

    def __init__(self, group: Any, peer: int, label: str, wire: torch.dtype | None = None) -> None:
        """``wire``: the dtype floating-point values cross in (None: their own)."""
        self._group = group
        self._peer = peer
        self.label = label
        self.wire = wire
        self.bytes_in = 0
        self.bytes_out = 0

    def send_values(self, *tensors: torch.Tensor) -> None:
        """Floating-point tensors in the wire dtype (fp16 saturates at its largest finite value)."""
        self.send(*(self._to_wire(t) for t in tensors))

    def recv_values(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """What ``send_values`` sent, back in ``dtype``."""
        if self.wire is None or not dtype.is_floating_point:
            return self.recv(shape, dtype)
        return self.recv(shape, self.wire).to(dtype)

    def _to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.wire is None or not tensor.is_floating_point() or tensor.dtype == self.wire:
            return tensor
        if self.wire == torch.float16:  # past 65504 a cast is inf, and one inf gradient ruins a shard
            tensor = tensor.clamp(-_FP16_MAX, _FP16_MAX)
        return tensor.to(self.wire)

    def send(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            tensor = tensor.detach().contiguous()
            self._group.send([tensor], self._peer, 0).wait(_OP_TIMEOUT)
            self.bytes_out += tensor.numel() * tensor.element_size()

    def recv_into(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            self._group.recv([tensor], self._peer, 0).wait(_OP_TIMEOUT)
            self.bytes_in += tensor.numel() * tensor.element_size()

    def send_header(self, *words: int) -> None:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[: len(words)] = torch.tensor(words, dtype=torch.int64)
        self.send(header)

    def recv_header(self) -> list[int]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self.recv_into(header)
        return [int(word) for word in header.tolist()]

    def recv(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self.recv_into(tensor)
        return tensor

    def send_json(self, doc: Any) -> None:
        data = torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8)
        self.send_header(data.numel())
        self.send(data)

    def recv_json(self) -> Any:
        (length, *_rest) = self.recv_header()
        data = self.recv((length,), torch.uint8)
        return json.loads(bytes(data.tolist()).decode())


def describe_state(state: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """An optimizer state entry as a message: JSON for its keys (a scalar's value, a tensor's
    shape and dtype), and its tensors, to send in key order after the JSON."""
    described: dict[str, Any] = {}
    tensors = []
    for key in sorted(state):
        value = state[key]
        if isinstance(value, torch.Tensor):
            described[key] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
            tensors.append(value.detach().contiguous())
        else:
            described[key] = {"value": value}
    return described, tensors


def receive_state(channel: Channel, described: dict[str, Any]) -> dict[str, Any]:
    """The state entry ``describe_state`` described, its tensors read from ``channel``."""
    state: dict[str, Any] = {}
    for key, spec in described.items():
        if "value" in spec:
            state[key] = spec["value"]
            continue
        dtype = getattr(torch, str(spec["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a torch dtype: {spec['dtype']!r}")
        state[key] = channel.recv(tuple(spec["shape"]), dtype)
    return state


def _pair(store: Any, connection: int, task: int, rank: int) -> Any:
    prefix = dist.PrefixStore(f"ps/conn{connection}/task{task}/", store)
    return dist.ProcessGroupGloo(prefix, rank, 2, _CONNECT_TIMEOUT)


def open_worker_channels(store: Any, num_tasks: int, worker: int, wire: torch.dtype | None = None) -> list[Channel]:
    """A worker's channels to every ps task (rank 1 of each pair; the ps is rank 0)."""
    connection = int(store.add(_JOINS_KEY, 1)) - 1
    store.set(f"ps/conn{connection}/worker", str(worker))
    return [Channel(_pair(store, connection, task, 1), 0, f"ps{task}", wire) for task in range(num_tasks)]


def accept_channel(store: Any, connection: int, task: int, wire: torch.dtype | None = None) -> tuple[Channel, int]:
    """The ps end of connection ``connection``: (its channel, the worker's index)."""
    worker = int(store.get(f"ps/conn{connection}/worker").decode())
    return Channel(_pair(store, connection, task, 0), 1, f"worker{worker}", wire), worker


def watch_joins(store: Any, on_join: Callable[[int], None], stopping: Callable[[], bool]) -> None:
    """Call ``on_join(connection)`` for each worker connection as it appears, until ``stopping()``.

    Polls the join counter rather than blocking in ``store.wait``: the store
    client is shared, and a blocked wait would hold it against every other user.
    """
    seen = 0
    while not stopping():
        try:
            joined = int(store.add(_JOINS_KEY, 0))
        except RuntimeError:  # the store's host (the chief) is gone: the job is ending or restarting
            time.sleep(10 * _POLL_S)
            continue
        while seen < joined:
            on_join(seen)
            seen += 1
        time.sleep(_POLL_S)
