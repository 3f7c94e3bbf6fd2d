"""AllocationWatch: a look that fails is no verdict, but a watch that only fails says so and stops.

The scheduler is a scripted stand-in (``scheduler_for`` patched): each look answers the
next item of a script, an exception being raised, a string being the allocation's end.
"""

from __future__ import annotations

import threading

import pytest

from distrun.client import _allocation_watch
from distrun.client._allocation_watch import AllocationWatch


class Scripted:
    """A scheduler whose ``ended()`` answers from ``script``, then ``then`` for ever."""

    def __init__(self, script: list, then: object = None) -> None:
        self.script, self.then, self.looks, self.closed = list(script), then, 0, False

    def ended(self) -> str | None:
        self.looks += 1
        answer = self.script.pop(0) if self.script else self.then
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def watch_of(monkeypatch):
    monkeypatch.setattr(_allocation_watch, "WATCH_INTERVAL_S", 0.001)
    monkeypatch.setattr(_allocation_watch, "GIVE_UP_AFTER", 5)

    def make(scheduler: Scripted) -> tuple[AllocationWatch, list[str], list[str]]:
        monkeypatch.setattr(_allocation_watch, "scheduler_for", lambda cluster: scheduler)
        reports: list[str] = []
        ends: list[str] = []
        return AllocationWatch(object(), ends.append, report=reports.append), reports, ends  # type: ignore[arg-type]

    return make


def test_a_look_that_always_fails_is_reported_once_then_the_watch_gives_up(watch_of) -> None:
    scheduler = Scripted([], then=OSError("Socket is closed"))
    watch, reports, ends = watch_of(scheduler)
    watch.start()
    watch._thread.join(timeout=10)
    assert not watch._thread.is_alive()  # it stopped by itself, not by stop()
    assert scheduler.looks == 5
    assert reports == [
        "could not ask whether the allocation still runs (OSError: Socket is closed); later failures are not shown",
        "stopped watching the allocation after 5 failed looks in a row (OSError: Socket is closed); the job goes "
        "on, but if the allocation ends, only its lost hosts will show it",
    ]
    assert ends == [] and watch.reason is None
    watch.stop()


def test_failures_between_good_looks_never_add_up_to_giving_up(watch_of) -> None:
    flaky = [OSError("busy")] * 4 + [None]
    scheduler = Scripted(flaky * 3 + ["Slurm job 7 on n1 ended: TIMEOUT"])
    watch, reports, ends = watch_of(scheduler)
    done = threading.Event()
    watch._on_end = lambda reason: (ends.append(reason), done.set())
    watch.start()
    assert done.wait(10)
    assert ends == ["Slurm job 7 on n1 ended: TIMEOUT"] == [watch.reason]
    assert reports == ["could not ask whether the allocation still runs (OSError: busy); later failures are not shown"]
    watch.stop()


def test_the_last_look_failing_is_reported(watch_of) -> None:
    scheduler = Scripted([RuntimeError("no\nroute")])
    watch, reports, _ = watch_of(scheduler)
    assert watch.check() is None
    assert reports == ["could not ask whether the allocation still runs (RuntimeError: no route); later failures "
                       "are not shown"]
    assert scheduler.closed
