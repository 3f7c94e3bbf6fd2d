"""``--elastic``: the flag, what it combines with, its events in the view, and the heal manifest."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from distrun.client._tracker import JobTracker
from distrun.config import JobSpec, StrategyName, parse_elastic
from distrun.errors import ConfigError
from distrun.protocol import MembershipChanged, Started, decode_event, encode_event
from distrun.strategies.elastic.heal import _describe, _optimizer_state
from distrun.strategies.elastic.replica import RECOVERIES_WITHOUT_PROGRESS, ElasticReplica, NoProgress
from distrun.ui import render_progress, render_summary


def test_elastic_reads_min_and_max_and_defaults_max_to_the_start():
    assert parse_elastic("2:4", 3) == (2, 4)
    assert parse_elastic("2", 3) == (2, 3)
    assert parse_elastic("1:2", 2, unit="worker host", scale=4) == (4, 8)  # hosts of 4 slots


@pytest.mark.parametrize("text, message", [
    ("x", "expected MIN or MIN:MAX"),
    ("2:x", "expected MIN or MIN:MAX"),
    ("0:3", "needs 1 <= MIN <= the 3 replica(s)"),
    ("4:5", "needs 1 <= MIN <= the 3 replica(s)"),
    ("2:2", "needs 1 <= MIN <= the 3 replica(s) the job starts with <= MAX"),
])
def test_bad_elastic_ranges_name_the_flag(text, message):
    with pytest.raises(ConfigError, match="--elastic") as info:
        parse_elastic(text, 3)
    assert message in str(info.value)


def _spec(**changes) -> JobSpec:
    base = dict(recipe="/r.py", strategy=StrategyName.MIRRORED, replicas=3, elastic_min=2, elastic_max=3)
    return JobSpec.of(**{**base, **changes})


def test_elastic_is_for_replicas_that_hold_the_whole_state():
    assert _spec().strategy.elastic and not _spec(elastic_min=0, elastic_max=0).strategy.elastic
    with pytest.raises(ConfigError, match="--elastic: for --strategy mirrored, multi-worker or diloco"):
        _spec(strategy=StrategyName.CENTRAL_STORAGE)
    with pytest.raises(ConfigError, match="--elastic with --compile: not supported yet"):
        _spec(compile=True)
    with pytest.raises(ConfigError, match="--elastic with --compression powersgd"):
        _spec(compression="powersgd:2")
    _spec(compression="bf16")  # stateless on the wire: fine


def test_the_job_spec_carries_elastic_across_the_wire():
    spec = _spec()
    assert JobSpec.from_json(spec.to_json()) == spec


def _change(generation, world, *, left=(), joined=(), lost=0, recovery=1.2, step=9):
    return MembershipChanged(rank=0, time=1001.0 + generation, generation=generation, step=step, world_size=world,
                             left=list(left), joined=list(joined), recovery_s=recovery, steps_lost=lost)


def test_membership_events_fill_the_summary_and_the_live_line():
    event = _change(1, 2, left=["rank 2 on 10.0.0.3"])
    assert decode_event(encode_event(event)) == event
    tracker = JobTracker("r.py", "multi-worker", replicas=3, started_at=1000.0)
    for rank in range(3):
        tracker.update(Started(rank=rank, time=1000.5, pid=10 + rank, device="cpu", world_size=3, recipe_kind="fit"))
    tracker.update(event)
    line = tracker.snapshot().membership_line
    assert line == "membership: 2 replica(s) from step 10 (left: rank 2 on 10.0.0.3; recovered in 1.20 s; change 1)"
    tracker.update(_change(2, 3, joined=["rank 2 on 10.0.0.3"], recovery=0.4, step=15))
    summary = tracker.summary("succeeded")
    assert (summary.membership_changes, summary.steps_lost, summary.recovery_s, summary.world_size) == (2, 0, 1.2, 3)
    console = Console(width=140, record=True)
    console.print(render_progress(tracker.snapshot()))
    console.print(render_summary(summary))
    text = console.export_text()
    assert "joined: rank 2 on 10.0.0.3" in text
    assert "2 change(s), now 3 replica(s); 0 step(s) lost; longest recovery 1.2" in text


def test_steps_lost_add_up_from_what_each_new_group_reports():
    tracker = JobTracker("r.py", "mirrored", replicas=2, started_at=0.0)
    tracker.update(_change(1, 1, lost=2))
    tracker.update(_change(2, 2, lost=1))
    assert tracker.summary("succeeded").steps_lost == 3


def test_the_heal_manifest_is_json_and_rebuilds_adams_state():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    manifest, tensors = _describe(model.state_dict(), optimizer.state_dict(), {"step": 7, "position": [0, 7]})
    manifest = json.loads(json.dumps(manifest))  # what crosses the store: no pickle
    assert [name for name, _, _ in manifest["model"]] == ["weight", "bias"]
    assert len(tensors) == 6  # step, exp_avg, exp_avg_sq for each of two parameters
    rebuilt = _optimizer_state(manifest, [t.clone() for t in tensors])
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.5)  # a joiner: no state yet
    fresh.load_state_dict(rebuilt)
    assert fresh.param_groups[0]["lr"] == 0.1
    for index in (0, 1):
        torch.testing.assert_close(fresh.state_dict()["state"][index]["exp_avg"],
                                   optimizer.state_dict()["state"][index]["exp_avg"])
    assert manifest["values"] == {"step": 7, "position": [0, 7]}


class _Recovering(ElasticReplica):
    """An elastic replica whose every recovery tries nothing: only the cap across recoveries acts."""

    def __init__(self) -> None:
        self._elastic = object()  # type: ignore[assignment]
        self._recoveries_in_a_row = 0
        self.step = 7
        self.recovered = 0

    def _recover_once(self, failed_at: float, *, switch: bool) -> None:
        self.recovered += 1


def test_recoveries_without_a_committed_step_end_at_the_cap_naming_the_last_cause():
    replica = _Recovering()
    for _ in range(RECOVERIES_WITHOUT_PROGRESS):
        replica.recover(0.0, cause="DistNetworkError: Connection reset by peer")
    assert replica.recovered == RECOVERIES_WITHOUT_PROGRESS
    with pytest.raises(NoProgress, match=r"5 recoveries in a row and no step committed at step 8; the last "
                                         r"failure: DistBackendError: size mismatch"):
        replica.recover(0.0, cause="DistBackendError: size mismatch")
    assert replica.recovered == RECOVERIES_WITHOUT_PROGRESS
