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

Before either end trusts the other, the pair runs a mutual HMAC challenge keyed by the
job secret (``prove_worker``/``check_worker``): the ps sends a nonce, the worker answers
with its own nonce, its worker index and HMAC(secret, both nonces, the index), and the ps
answers with its own proof. The worker index a ps serves is the authenticated one, so the
chief-only operations (STATE, LOAD, FINISH, the step budget) are the chief's alone. Every
length a peer sends is checked against a limit before anything is allocated
(``check_header``, ``MAX_JSON_BYTES``).

``--compression fp16|bf16``: both ends agree on a wire dtype, and the values of a
step (gradients pushed, parameters and rows pulled) cross in it through
``send_values``/``recv_values``; the ps keeps and updates fp32. Checkpoint state
(STATE, LOAD) always crosses exact.
"""

from __future__ import annotations

import hmac
import json
import math
import os
import struct
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distrun.protocol.wire import mac

__all__ = ["Channel", "Op", "HEADER_LEN", "MAX_JSON_BYTES", "CHIEF_OPS", "PeerRefused", "open_worker_channels",
           "accept_channel", "watch_joins", "describe_state", "receive_state", "check_header", "prove_worker",
           "check_worker", "lr_factor_word", "push_lr_factor", "elastic_round"]

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
#: The largest JSON document either end reads (a checkpoint's description of one task's
#: optimizer state: keys, shapes and scalars; never tensors).
MAX_JSON_BYTES = 16 * 1024 * 1024
#: The largest tensor a peer may ask a task to receive outside the placement (a LOAD's
#: optimizer state entry): 4 GiB.
MAX_STATE_BYTES = 4 * 1024**3
_NONCE = 32
_MAC = 32


class PeerRefused(RuntimeError):
    """The peer at the other end of a pair could not prove the job secret, or broke the wire's limits."""


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
        if not 0 <= length <= MAX_JSON_BYTES:
            raise PeerRefused(f"{self.label} announced a JSON document of {length} bytes (limit {MAX_JSON_BYTES})")
        data = self.recv((length,), torch.uint8)
        try:
            return json.loads(data.numpy().tobytes().decode())
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise PeerRefused(f"{self.label} sent a document that is not JSON") from None

    def send_bytes(self, data: bytes) -> None:
        self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def recv_bytes(self, size: int) -> bytes:
        return self.recv((size,), torch.uint8).numpy().tobytes()


class Op:
    """Header word 0: what a worker asks of a ps task (see ``check_header`` for each one's words)."""

    PULL = 1  # dense parameters and the version they are at
    PUSH = 2  # gradients (dense, then touched rows of partitioned embeddings); the reply is a PULL's.
    # Words: the version pulled, the chief's step budget, the worker's lr factor (lr_factor_word).
    ROWS = 3  # rows of a partitioned embedding
    STATE = 4  # everything, for a checkpoint
    LOAD = 5  # everything, from a checkpoint
    FINISH = 6  # the chief: the job is over
    BYE = 7  # a worker leaves
    # --embeddings ps --elastic (``elastic_round``): a round is staged when whole, applied on the word.
    DECIDE = 8  # words: the staged round's number, 1 to apply it or 0 to drop it (no reply)
    ABANDON = 9  # words: a membership round's tag; its rounds that are not whole can never be (no reply)


#: What only the chief (worker 0) may ask: reading or replacing every parameter, ending the job.
CHIEF_OPS = frozenset({Op.STATE, Op.LOAD, Op.FINISH})


def check_header(words: list[int], *, chief: bool, sparse_slots: int, max_rows: int) -> tuple[int, ...]:
    """A request's header, validated before anything is allocated for it: (op, *its words).

    ``chief``: the authenticated peer is worker 0; ``sparse_slots``: partitioned embeddings
    this task holds; ``max_rows``: rows in its largest. Raises PeerRefused naming what is wrong.
    """
    if len(words) != HEADER_LEN:
        raise PeerRefused(f"a header has {HEADER_LEN} words. Received: {len(words)}")
    op = words[0]
    if op in CHIEF_OPS and not chief:
        raise PeerRefused(f"op {op} is the chief's alone")
    if op == Op.PUSH:
        pulled, limit = words[1], words[2]
        if pulled < 0 or limit < 0:
            raise PeerRefused(f"PUSH: negative version or budget. Received: {pulled}, {limit}")
        return (op, pulled, limit if chief else 0)  # the step budget is the chief's to set
    if op == Op.ROWS:
        slot, count = words[1], words[2]
        if not 0 <= slot < sparse_slots:
            raise PeerRefused(f"ROWS: slot {slot} of {sparse_slots}")
        if not 0 <= count <= max_rows:
            raise PeerRefused(f"ROWS: {count} rows asked of {max_rows}")
        return (op, slot, count)
    if op == Op.DECIDE:
        if words[1] < 0 or words[2] not in (0, 1):
            raise PeerRefused(f"DECIDE: round {words[1]}, verdict {words[2]}")
        return (op, words[1], words[2])
    if op == Op.ABANDON:
        if words[1] <= 0:
            raise PeerRefused(f"ABANDON: membership round tag {words[1]}")
        return (op, words[1])
    if op in (Op.PULL, Op.STATE, Op.LOAD, Op.FINISH, Op.BYE):
        return (op,)
    raise PeerRefused(f"unknown op {op}")


def lr_factor_word(factor: float) -> int:
    """A PUSH's word 3: the pushing worker's lr over the recipe's (its scheduler's factor), as the
    bits of a float64. The ps task applies the push with its groups' lr times it."""
    return struct.unpack("<q", struct.pack("<d", float(factor)))[0]


def push_lr_factor(words: list[int]) -> float:
    """Word 3 of a checked PUSH header: the lr factor (0 bits, a worker that sends none: 1.0)."""
    if words[3] == 0:
        return 1.0
    factor = struct.unpack("<d", struct.pack("<q", words[3]))[0]
    if not math.isfinite(factor) or factor < 0:
        raise PeerRefused(f"PUSH: an lr factor must be a finite number >= 0. Received: {factor}")
    return factor


#: The most replicas a membership round may name (a bound on what a peer may claim, not a limit in use).
_MAX_MEMBERS = 1 << 20


def elastic_round(words: list[int]) -> tuple[int, int]:
    """``--embeddings ps --elastic``: (tag, members) a checked PUSH header carries in words 4 and 5,
    or a ROWS header in word 3 (no members): the replica's membership round, as its generation + 1
    (0: not elastic), and how many replicas that round has. Under a tag, a ps task stages a round
    once ``members`` pushes of that tag are in, and applies it only when a replica says every task
    staged its own (``Op.DECIDE``): a step is applied on every task or on none."""
    op = words[0]
    tag, members = (words[4], words[5]) if op == Op.PUSH else (words[3], 0)
    if tag < 0 or (op == Op.PUSH and tag and not 1 <= members <= _MAX_MEMBERS):
        raise PeerRefused(f"a membership round tag {tag} of {members} replica(s)")
    return tag, members


def prove_worker(channel: Channel, secret: bytes, worker: int) -> None:
    """The worker's side of the pair's handshake (see the module's docstring)."""
    ps_nonce = channel.recv_bytes(_NONCE)
    nonce = os.urandom(_NONCE)
    index = worker.to_bytes(8, "big", signed=True)
    channel.send_bytes(nonce + index + mac(secret, b"ps-worker", ps_nonce, nonce, index))
    answer = channel.recv_bytes(1 + _MAC)
    if answer[0] != 1 or not hmac.compare_digest(answer[1:], mac(secret, b"ps-task", nonce, ps_nonce)):
        raise PeerRefused(f"{channel.label} could not prove the job secret")


def check_worker(channel: Channel, secret: bytes) -> int:
    """The ps side of the pair's handshake: the worker's index, once it has proven the secret."""
    ps_nonce = os.urandom(_NONCE)
    channel.send_bytes(ps_nonce)
    hello = channel.recv_bytes(_NONCE + 8 + _MAC)
    nonce, index, proof = hello[:_NONCE], hello[_NONCE:_NONCE + 8], hello[_NONCE + 8:]
    if not hmac.compare_digest(proof, mac(secret, b"ps-worker", ps_nonce, nonce, index)):
        channel.send_bytes(bytes(1 + _MAC))
        raise PeerRefused("a peer could not prove the job secret")
    channel.send_bytes(b"\x01" + mac(secret, b"ps-task", nonce, ps_nonce))
    worker = int.from_bytes(index, "big", signed=True)
    if worker < 0:
        raise PeerRefused(f"worker index {worker}")
    return worker


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
    """The state entry ``describe_state`` described, its tensors read from ``channel``
    (each shape checked against ``MAX_STATE_BYTES`` before it is allocated)."""
    if not isinstance(described, dict):
        raise PeerRefused("a state entry is not a JSON object")
    state: dict[str, Any] = {}
    for key, spec in described.items():
        if not isinstance(spec, dict):
            raise PeerRefused(f"state entry {key!r} is not a JSON object")
        if "value" in spec:
            state[key] = spec["value"]
            continue
        dtype = getattr(torch, str(spec.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise PeerRefused(f"not a torch dtype: {spec.get('dtype')!r}")
        shape = spec.get("shape")
        if not isinstance(shape, list) or not all(isinstance(n, int) and 0 <= n for n in shape):
            raise PeerRefused(f"state entry {key!r}: not a shape: {shape!r}")
        span = 1  # the elements the shape would hold were no dimension 0: torch's strides must fit too
        for n in shape:
            span *= max(n, 1)
        if span * dtype.itemsize > MAX_STATE_BYTES:
            raise PeerRefused(f"state entry {key!r}: shape {shape} of {dtype} exceeds the limit")
        state[key] = channel.recv(tuple(shape), dtype)
    return state


def _pair(store: Any, connection: int, task: int, rank: int) -> Any:
    prefix = dist.PrefixStore(f"ps/conn{connection}/task{task}/", store)
    return dist.ProcessGroupGloo(prefix, rank, 2, _CONNECT_TIMEOUT)


def open_worker_channels(store: Any, num_tasks: int, worker: int, secret: bytes,
                         wire: torch.dtype | None = None) -> list[Channel]:
    """A worker's channels to every ps task (rank 1 of each pair; the ps is rank 0), each
    authenticated both ways with the job ``secret``."""
    connection = int(store.add(_JOINS_KEY, 1)) - 1
    channels = []
    for task in range(num_tasks):
        channel = Channel(_pair(store, connection, task, 1), 0, f"ps{task}", wire)
        prove_worker(channel, secret, worker)
        channels.append(channel)
    return channels


def accept_channel(store: Any, connection: int, task: int, secret: bytes,
                   wire: torch.dtype | None = None) -> tuple[Channel, int]:
    """The ps end of connection ``connection``: (its channel, the worker's proven index)."""
    channel = Channel(_pair(store, connection, task, 0), 1, f"connection {connection}", wire)
    worker = check_worker(channel, secret)
    channel.label = f"worker{worker}"
    return channel, worker


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
