"""A stop is one decision: ranks that die after it are part of the stop, failures before it are not.

Real processes under the real launcher (plain Python children, no torch): the interleaving
of a multi-host cancel, where a rank sees its peer on another host vanish before its own
host is told to kill, is forced here by killing or signalling a rank after ``stopping()``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time

import pytest

from distrun.client._job_state import STATE_ORDER, blame, host_failures, host_words, merge_states
from distrun.launch import LocalLauncher, ProcessState, WorkerSpec
from distrun.launch._stop import StopDecision
from distrun.protocol import PEER_LOST, EventDecodeError, Failed, decode_event, event_to_dict

# Each rank waits for SIGUSR2, then writes a Failed event and exits 1; rank 1's is stamped AGE
# seconds ago (the others' now): AGE 0 is a rank that saw its peer vanish now; AGE 30 one whose
# failure happened long before its event was read. With "late", rank 1 does so on the launcher's
# SIGTERM instead: its event is read only once the launcher is already stopping.
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time
    rank = int(os.environ["RANK"])
    age_s = float(sys.argv[1]) if rank == 1 else 0.0
    fd = int(os.environ["DISTRUN_EVENT_FD"])
    print("ready", flush=True)
    def fail(*_):
        os.write(fd, (json.dumps({"type": "error", "rank": rank, "time": time.time() - age_s,
                                  "kind": "peer-lost", "message": "RuntimeError: Connection closed by peer"})
                      + "\\n").encode())
        os._exit(1)
    late = rank == 1 and sys.argv[2:] == ["late"]
    signal.signal(signal.SIGTERM if late else signal.SIGUSR2, fail)
    time.sleep(600)
    """
)


def _started(age_s: float = 0.0, n: int = 2, *mode: str) -> tuple[LocalLauncher, list, threading.Thread, dict]:
    events: list = []
    spec = WorkerSpec(argv=(sys.executable, "-c", CHILD, str(age_s), *mode), local_world_size=n, stop_grace_s=2.0)
    launcher = LocalLauncher(spec, events.append)
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("result", launcher.run()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while sum(getattr(e, "line", None) == "ready" for e in events) < n:
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)
    return launcher, events, thread, outcome


def _finished(thread: threading.Thread, outcome: dict, within_s: float):
    thread.join(within_s)
    assert not thread.is_alive(), f"the launcher did not end within {within_s} s"
    return outcome["result"]


def test_a_rank_that_dies_after_the_decision_is_part_of_the_stop_and_ends_it_at_once() -> None:
    launcher, _events, thread, outcome = _started()
    launcher.stopping("cancelled by alice from laptop", kill_after_s=60)
    os.kill(launcher.pids[1], signal.SIGUSR2)  # its peer on another host was killed first
    t0 = time.monotonic()
    result = _finished(thread, outcome, 20)
    assert result.state is ProcessState.STOPPED and result.failure is None
    assert time.monotonic() - t0 < 10  # not the 60 s the decision would wait for its kill
    assert launcher.stop_reason == "cancelled by alice from laptop"


def test_a_rank_killed_from_outside_after_the_decision_is_part_of_the_stop() -> None:
    launcher, _events, thread, outcome = _started()
    launcher.stopping("cancelled", kill_after_s=60)
    os.kill(launcher.pids[0], signal.SIGKILL)  # not the launcher's own kill
    result = _finished(thread, outcome, 20)
    assert result.state is ProcessState.STOPPED and result.failure is None


def test_a_failure_stamped_before_the_decision_is_still_the_jobs_failure() -> None:
    launcher, _events, thread, outcome = _started(age_s=30)
    launcher.stopping("cancelled", kill_after_s=60)
    os.kill(launcher.pids[1], signal.SIGUSR2)  # its event arrives after the decision, stamped before
    result = _finished(thread, outcome, 20)
    assert result.state is ProcessState.FAILED
    assert result.failure is not None and result.failure.rank == 1


def test_an_own_failure_read_after_the_stop_began_still_fails_the_job() -> None:
    """Rank 0 dies of the stop (stamped after the decision), so the launcher is already stopping when
    rank 1's own failure, stamped before the decision, is read (rank 1 reports it on the launcher's
    SIGTERM): the run is the job's failure, not a stop with a root cause."""
    launcher, _events, thread, outcome = _started(30, 2, "late")
    launcher.stopping("cancelled", kill_after_s=60)
    os.kill(launcher.pids[0], signal.SIGUSR2)
    result = _finished(thread, outcome, 20)
    assert result.state is ProcessState.FAILED and result.failure is not None and result.failure.rank == 1


def test_without_the_decision_the_same_death_is_a_failure() -> None:
    launcher, _events, thread, outcome = _started()
    os.kill(launcher.pids[1], signal.SIGUSR2)
    result = _finished(thread, outcome, 20)
    assert result.state is ProcessState.FAILED and result.failure.rank == 1


def test_a_decision_whose_kill_never_comes_kills_on_its_own() -> None:
    launcher, _events, thread, outcome = _started()
    t0 = time.monotonic()
    launcher.stopping("the client died between the phases", kill_after_s=1.0)
    result = _finished(thread, outcome, 20)
    assert result.state is ProcessState.STOPPED
    assert 1.0 <= time.monotonic() - t0 < 10


def test_the_first_reason_wins_and_a_request_kills_at_once() -> None:
    decision = StopDecision()
    assert not decision.decided and not decision.kill_due()
    decision.decide("cancelled by alice from laptop", kill_after_s=60)
    decision.request("client exiting")
    assert decision.reason == "cancelled by alice from laptop" and decision.kill_due()
    before = Failed(rank=1, time=time.time() - 1, kind="raised", message="x")
    after = Failed(rank=1, time=time.time() + 1, kind=PEER_LOST, message="x")
    assert not decision.part_of_stop(before) and decision.part_of_stop(after)


# Every pair of host states, and the job's state they make: (a, b) -> merged.
PAIRS = {
    ("running", "pending"): "running", ("running", "failed"): "running", ("running", "preempted"): "running",
    ("running", "stopped"): "running", ("running", "succeeded"): "running", ("running", "lost"): "running",
    ("pending", "failed"): "pending", ("pending", "preempted"): "pending", ("pending", "stopped"): "pending",
    ("pending", "succeeded"): "pending", ("pending", "lost"): "pending",
    ("failed", "preempted"): "failed", ("failed", "stopped"): "failed", ("failed", "succeeded"): "failed",
    ("failed", "lost"): "failed",
    ("preempted", "stopped"): "preempted", ("preempted", "succeeded"): "preempted", ("preempted", "lost"): "preempted",
    ("stopped", "succeeded"): "stopped", ("stopped", "lost"): "stopped",
    ("succeeded", "lost"): "succeeded",
}


def test_the_table_covers_every_pair() -> None:
    from itertools import combinations
    assert set(PAIRS) == set(combinations(STATE_ORDER, 2))


@pytest.mark.parametrize(("pair", "merged"), sorted(PAIRS.items()))
def test_host_states_merge_the_same_in_either_order(pair: tuple[str, str], merged: str) -> None:
    first, second = pair
    assert merge_states([first, second]) == merge_states([second, first]) == merged
    assert merge_states([first, first]) == first


def test_a_state_this_client_does_not_know_is_shown_not_hidden() -> None:
    assert merge_states(["failed", "draining"]) == "draining"
    assert merge_states(["running", "draining"]) == "running"
    assert merge_states([]) == "unknown"


def test_blame_names_the_rank_that_failed_on_its_own_not_the_one_that_lost_its_peer() -> None:
    own = event_to_dict(Failed(rank=1, time=200.0, kind="raised", message="RuntimeError: boom", file="r.py", line=9,
                               step=5))
    peer = event_to_dict(Failed(rank=0, time=100.0, kind=PEER_LOST, message="Connection closed by peer"))
    assert blame([("h1", {"failure": peer}), ("h2", {"failure": own})]) == \
        "h2: r.py:9: rank 1 failed at step 5: RuntimeError: boom"
    assert blame([("h1", {"failure": peer}), ("h2", {"error": "the worker server went silent"})]) == \
        "h2: the worker server went silent"
    assert blame([("h1", {"failure": peer})]).startswith("h1: rank 0 failed")
    assert blame([("h1", {"failure": None})]) is None


def test_a_failure_this_client_cannot_decode_is_its_hosts_in_its_own_words() -> None:
    """A server of another version recorded a failure this client's decoder refuses: the live view
    (``ClusterJob.outcome``) and ``distrun jobs`` both blame its host in the server's words, before a
    rank that only lost its peer; the live view once raised the decoder's error instead."""
    newer = {"type": "error", "rank": 1, "time": 50.0, "kind": "raised", "message": "boom from a newer server",
             "causes": ["a field this client does not know"]}
    with pytest.raises(EventDecodeError):
        decode_event(json.dumps(newer))
    peer = event_to_dict(Failed(rank=0, time=100.0, kind=PEER_LOST, message="Connection closed by peer"))
    parts = [("h1", {"failure": peer}), ("h2", {"failure": newer})]
    assert [(host, failure is None) for host, failure in host_failures(parts)] == [("h1", False), ("h2", True)]
    assert blame(parts) == "h2: boom from a newer server"
    assert host_words({"failure": {"kind": "?"}}) == "failed"
    assert host_words({"error": "the worker server went silent"}) == "the worker server went silent"


class _Link:
    """A host as stop_everywhere sees it: a label and a control call (what the server answers is the test's)."""

    def __init__(self, label: str, answers: dict) -> None:
        self.label, self.answers, self.calls = label, answers, []
        self._lock = threading.Lock()  # one control connection: calls queue, as HostLink's do

    def call(self, op: str, **args: object) -> dict:
        with self._lock:
            self.calls.append((op, time.monotonic()))
            answer = self.answers.get(op)
            if isinstance(answer, Exception):
                raise answer
            if answer == "hang":
                time.sleep(60)
            return {}


def test_every_host_decides_before_any_is_killed_and_every_host_gets_the_kill(monkeypatch) -> None:
    from distrun.client import _stop
    from distrun.errors import HostError

    monkeypatch.setattr(_stop, "PHASE_S", 0.5)
    ok = _Link("h1", {})
    old = _Link("h2", {"stopping": HostError("h2", "the worker server failed 'stopping': unknown op")})
    stuck = _Link("h3", {"stopping": "hang"})
    t0 = time.monotonic()
    errors = _stop.stop_everywhere([ok, old, stuck], "job", "cancelled by alice from laptop")
    assert time.monotonic() - t0 < 5  # a host that never answers holds no one up for long
    assert [op for op, _ in ok.calls] == ["stopping", "cancel"] == [op for op, _ in old.calls]
    kills = [at for link in (ok, old) for op, at in link.calls if op == "cancel"]
    decisions = [at for link in (ok, old, stuck) for op, at in link.calls if op == "stopping"]
    assert max(decisions) < min(kills)
    assert [op for op, _ in stuck.calls] == ["stopping"]  # still stuck in its first call: named, not waited for
    assert [error.host for error in errors] == ["h3"]


def test_a_restart_names_the_rank_that_failed_first_not_the_host_that_answered_first() -> None:
    """--elastic below MIN: a rejoining rank that lost its store ended (and was heard) first, but the
    restart line and the error name the rank that fell below the minimum, which failed earlier."""
    from distrun.protocol.root_cause import root_cause

    rejoiner = Failed(rank=1, time=2.25, kind="raised", message="DistNetworkError: Failed to recv, got 0 bytes")
    below = Failed(rank=0, time=2.05, kind="raised", message="BelowMinimum: 2 replica(s) left")
    assert root_cause([("h2", rejoiner), ("h1", below), ("h3", None)]) == ("h1", below)


@pytest.mark.parametrize("text", [
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4242",
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:600] Read error: No route to host. This is typically "
    "caused by a remote worker crashing. Check the logs of the remote worker before reporting an error.",
])
def test_a_gloo_error_from_a_peer_that_went_is_peer_lost_not_the_root_cause(text: str) -> None:
    """The rank that lost its peer is not blamed for the job's failure (a 2-host job whose rank 1
    was SIGKILLed named rank 0's gloo error once: torch's wording varies with what the socket said)."""
    from distrun.runtime._failure import describe_failure

    failed = describe_failure(RuntimeError(text), rank=0, recipe="/r/recipe.py", step=11, phase="train")
    assert failed.kind == PEER_LOST
