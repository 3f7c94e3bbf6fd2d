"""The parameter-server wire's parsers under hostile input, as the control plane's are fuzzed.

A ps task reads an 8-word header, JSON documents and state descriptions from its peers.
Whatever the words, it either refuses them (PeerRefused, a RuntimeError the serving thread
turns into a dropped connection) or returns a request within its limits: never a chief's
operation to a worker, never a step budget from a worker, never an allocation past a limit.
The handshake runs over a real two-member gloo group.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

from distrun.strategies.ps.channel import (
    CHIEF_OPS,
    HEADER_LEN,
    MAX_JSON_BYTES,
    MAX_STATE_BYTES,
    Channel,
    Op,
    PeerRefused,
    check_header,
    check_worker,
    prove_worker,
    receive_state,
)

_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_KNOWN = [Op.PULL, Op.PUSH, Op.ROWS, Op.STATE, Op.LOAD, Op.FINISH, Op.BYE]


@settings(max_examples=400, deadline=None)
@given(words=st.lists(st.one_of(st.sampled_from(_KNOWN), _INT64), min_size=HEADER_LEN, max_size=HEADER_LEN),
       chief=st.booleans(), slots=st.integers(0, 3), rows=st.integers(0, 10_000))
def test_a_header_is_refused_or_within_its_limits(words: list[int], chief: bool, slots: int, rows: int) -> None:
    try:
        request = check_header(words, chief=chief, sparse_slots=slots, max_rows=rows)
    except PeerRefused:
        return
    op = request[0]
    assert op in _KNOWN
    assert chief or op not in CHIEF_OPS
    if op == Op.PUSH:
        assert request[1] >= 0 and request[2] >= 0
        assert chief or request[2] == 0  # only the chief sets the step budget
    if op == Op.ROWS:
        assert 0 <= request[1] < slots and 0 <= request[2] <= rows


def test_the_attacks_seen_on_the_wire_are_refused() -> None:
    """What the issue's stranger did once it had a pair: read everything, replace it, end the job."""
    for op in (Op.STATE, Op.LOAD, Op.FINISH):
        with pytest.raises(PeerRefused, match="chief's alone"):
            check_header([op, 0, 0, 0, 0, 0, 0, 0], chief=False, sparse_slots=1, max_rows=10)
    assert check_header([Op.PUSH, 0, 1, 0, 0, 0, 0, 0], chief=False, sparse_slots=0, max_rows=0) == (Op.PUSH, 0, 0)
    with pytest.raises(PeerRefused, match="rows asked"):
        check_header([Op.ROWS, 0, 2**40, 0, 0, 0, 0, 0], chief=True, sparse_slots=1, max_rows=10)
    with pytest.raises(PeerRefused, match="unknown op"):
        check_header([99, 0, 0, 0, 0, 0, 0, 0], chief=True, sparse_slots=0, max_rows=0)


class _Recorded(Channel):
    """A channel whose peer's words are given up front: what a task would be asked to allocate."""

    def __init__(self, header: list[int] | None = None) -> None:
        super().__init__(group=None, peer=0, label="peer")
        self._header = header or [0] * HEADER_LEN
        self.allocated = 0

    def recv_header(self) -> list[int]:
        return list(self._header)

    def recv_into(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            self.allocated += tensor.numel() * tensor.element_size()


_SHAPES = st.lists(st.integers(-5, 2**40), max_size=4)
_ENTRY = st.one_of(st.fixed_dictionaries({"value": st.integers() | st.floats(allow_nan=False) | st.text()}),
                   st.fixed_dictionaries({"shape": _SHAPES | st.text() | st.none(),
                                          "dtype": st.sampled_from(["float32", "int64", "bfloat16", "Tensor", "os"])}),
                   st.integers(), st.text())


@settings(max_examples=300, deadline=None)
@example(described={"": {"shape": [0, 2897, 2897, 1098987458710], "dtype": "float32"}})  # no elements; strides overflow
@given(described=st.dictionaries(st.text(max_size=8), _ENTRY, max_size=4) | st.lists(st.integers()) | st.text())
def test_a_state_description_never_allocates_past_the_limit(described: Any) -> None:
    channel = _Recorded()
    try:
        state = receive_state(channel, described)
    except PeerRefused:
        assert channel.allocated <= MAX_STATE_BYTES
        return
    assert channel.allocated <= MAX_STATE_BYTES * max(1, len(state))


@pytest.mark.parametrize("length", [-1, MAX_JSON_BYTES + 1, 2**62])
def test_a_json_document_past_the_limit_is_refused_before_it_is_read(length: int) -> None:
    channel = _Recorded([length] + [0] * (HEADER_LEN - 1))
    with pytest.raises(PeerRefused, match="JSON document"):
        channel.recv_json()
    assert channel.allocated == 0


def _pair_of_channels() -> tuple[Channel, Channel]:
    """Both ends of a real two-member gloo group, in this process."""
    store = dist.HashStore()
    groups: dict[int, Any] = {}

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("pair/", store), rank, 2, timedelta(seconds=30))

    threads = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return Channel(groups[0], 1, "worker"), Channel(groups[1], 0, "ps0")


@pytest.mark.parametrize("worker_secret, expected", [(b"k" * 32, 3), (b"x" * 32, None)])
def test_the_pairs_handshake_admits_only_the_jobs_secret(worker_secret: bytes, expected: int | None) -> None:
    ps_end, worker_end = _pair_of_channels()
    outcome: dict[str, Any] = {}

    def worker() -> None:
        try:
            prove_worker(worker_end, worker_secret, 3)
            outcome["worker"] = "ok"
        except PeerRefused as exc:
            outcome["worker"] = str(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        outcome["ps"] = check_worker(ps_end, b"k" * 32)
    except PeerRefused as exc:
        outcome["ps"] = str(exc)
    thread.join(timeout=30)
    if expected is None:
        assert outcome == {"ps": "a peer could not prove the job secret", "worker": "ps0 could not prove the job secret"}
    else:
        assert outcome == {"ps": expected, "worker": "ok"}
