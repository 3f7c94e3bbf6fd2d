"""An attached client's Ctrl-C detaches at once, whatever its followers are doing (client/cluster_job).

A CI run's `distrun attach` outlived its Ctrl-C by 30 s: the view waited for every follower to wake
from its closed stream, and the job the test then never cancelled failed the four tests after it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

from distrun.cli._run import run_job
from distrun.client._feed import EventFeed
from distrun.client._tracker import JobTracker
from distrun.client.cluster_job import DETACH_WAIT_S, ClusterJob
from distrun.config import parse_cluster
from distrun.errors import Interrupted
from distrun.protocol import JobSummary


def _attached_with_a_follower_that_never_wakes() -> tuple[ClusterJob, threading.Event]:
    cluster = parse_cluster("hosts:\n  - {address: 10.0.0.1, roles: [chief, worker]}\n", "lab.yaml")
    job = ClusterJob(cluster, "20261127-120000-abcdef", [], (), attached=True)
    job._feed = EventFeed(JobTracker("slow.py", "multi-worker", 2, started_at=time.time()))
    stuck = threading.Event()
    job._supervisor = threading.Thread(target=stuck.wait, name="job-supervisor", daemon=True)
    job._supervisor.start()
    return job, stuck


def _view_ends(job: ClusterJob, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    for _event in job.events(poll_s=0.05):
        if time.monotonic() > deadline:
            return False
    return True


def test_ctrl_c_ends_the_view_and_detaches_without_waiting_for_the_followers() -> None:
    job, stuck = _attached_with_a_follower_that_never_wakes()
    try:
        t0 = time.monotonic()
        job.cancel("interrupted", interrupted=True)
        assert _view_ends(job, 2.0), "the view waited for a follower that never wakes"
        with pytest.raises(Interrupted, match="detached from job 20261127-120000-abcdef; it goes on"):
            job.outcome()
        assert time.monotonic() - t0 < DETACH_WAIT_S + 2.0
        assert not job._user_cancelled and not job._cancelled.is_set()  # the job itself was not stopped
    finally:
        stuck.set()


def test_leaving_an_attached_job_never_cancels_it() -> None:
    """The client leaving for any other reason (an error in the view) also only detaches: ``with job``'s
    exit once cancelled whatever job was still followed, an attached one included."""
    job, stuck = _attached_with_a_follower_that_never_wakes()
    try:
        t0 = time.monotonic()
        job.__exit__(None, None, None)
        assert time.monotonic() - t0 < DETACH_WAIT_S + 2.0
        assert not job._user_cancelled and not job._cancelled.is_set()
        assert _view_ends(job, 2.0)
    finally:
        stuck.set()


class _WindingDown:
    """A job whose end a second Ctrl-C interrupts: ``outcome()`` raises KeyboardInterrupt."""

    spec = None

    def __enter__(self) -> _WindingDown:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def events(self, poll_s: float = 0.25) -> Iterator[None]:
        return iter(())

    def outcome(self) -> None:
        raise KeyboardInterrupt

    def summary(self, status: str, error: str | None = None) -> JobSummary:
        return JobSummary(status=status, recipe="slow.py", strategy="multi-worker", replicas=2, steps=3,
                          final_loss=None, samples_per_s=0.0, time_to_first_step_s=None, wall_s=1.0, error=error)


def test_a_second_ctrl_c_while_the_job_winds_down_is_never_a_success(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary once read ``succeeded`` when Ctrl-C came again while the client waited for the job's end."""
    with pytest.raises(KeyboardInterrupt):
        run_job(_WindingDown(), json_output=True)  # type: ignore[arg-type]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["type"], summary["status"], summary["error"]) == ("summary", "interrupted", "interrupted")
