"""One rule names a failed job's root cause, whichever order the hosts answered in.

The launcher (``StopDecision.root_cause``), a cluster job's outcome (``root_cause`` itself)
and ``distrun jobs`` (``blame``) once broke ties by list order: the first host heard, or
the first host in the cluster file, so the live view and ``distrun jobs`` could name
different hosts for one failure. Every case here is checked in every input order.
"""

from __future__ import annotations

import itertools

import pytest

from distrun.client._job_state import blame
from distrun.launch._stop import StopDecision
from distrun.protocol import PEER_LOST, Failed, event_to_dict
from distrun.protocol.root_cause import root_cause


def _failed(rank: int, at: float, kind: str = "raised") -> Failed:
    return Failed(rank=rank, time=at, kind=kind, message=f"rank {rank} {kind}")


OWN_LATE = ("h1", _failed(1, 9.0))
OWN_EARLY = ("h2", _failed(2, 5.0))
PEER_EARLIEST = ("h0", _failed(0, 1.0, PEER_LOST))
LOST_B = ("hb", None)
LOST_A = ("ha", None)

CASES = {
    "a rank's own failure beats an earlier lost peer": ([OWN_LATE, PEER_EARLIEST], OWN_LATE),
    "a rank's own failure beats a lost host": ([LOST_A, OWN_LATE], OWN_LATE),
    "a lost host beats a lost peer": ([PEER_EARLIEST, LOST_B], LOST_B),
    "the earliest own failure wins": ([OWN_LATE, OWN_EARLY, PEER_EARLIEST, LOST_A], OWN_EARLY),
    "only lost peers: the earliest": ([("h3", _failed(3, 2.0, PEER_LOST)), PEER_EARLIEST], PEER_EARLIEST),
    "equal times: the lower rank": ([("h1", _failed(1, 5.0)), ("h2", _failed(2, 5.0))], ("h1", _failed(1, 5.0))),
    "equal times, lost peers: the lower rank":
        ([("h4", _failed(4, 5.0, PEER_LOST)), ("h3", _failed(3, 5.0, PEER_LOST))],
         ("h3", _failed(3, 5.0, PEER_LOST))),
    "equal time and rank: the host first by name": ([("h9", _failed(0, 5.0)), ("h1", _failed(0, 5.0))],
                                                    ("h1", _failed(0, 5.0))),
    "two lost hosts: the first by name": ([LOST_B, LOST_A], LOST_A),
}


def _orders(records: list) -> list[list]:
    return [list(order) for order in itertools.permutations(records)]


@pytest.mark.parametrize(("records", "expected"), CASES.values(), ids=CASES.keys())
def test_the_root_cause_is_the_same_in_every_order(records: list, expected: tuple) -> None:
    for order in _orders(records):
        assert root_cause(order) == expected, order


def test_nothing_to_blame_is_none() -> None:
    assert root_cause([]) is None
    assert StopDecision().root_cause([]) is None
    assert blame([("h1", {"state": "failed"})]) is None


@pytest.mark.parametrize(("records", "expected"),
                         [case for case in CASES.values() if all(f is not None for _, f in case[0])],
                         ids=[name for name, case in CASES.items() if all(f is not None for _, f in case[0])])
def test_the_launcher_blames_by_the_same_rule(records: list, expected: tuple) -> None:
    """One host's ranks: the host plays no part, the failure is the one the rule picks."""
    for order in _orders(records):
        assert StopDecision().root_cause([failure for _, failure in order]) == expected[1], order


@pytest.mark.parametrize(("records", "expected"), CASES.values(), ids=CASES.keys())
def test_distrun_jobs_blames_the_host_the_live_view_does(records: list, expected: tuple) -> None:
    """``blame`` reads each host's ``jobs`` entry (a lost host is one with an ``error``) and
    names the host ``root_cause`` (a cluster job's outcome) names."""
    host, _ = expected
    for order in _orders(records):
        parts = [(label, {"failure": event_to_dict(f)} if f is not None else {"error": "the server went silent"})
                 for label, f in order]
        assert blame(parts).startswith(f"{host}: "), order
