"""The reporter's rates leave evaluation out: samples/s (the events' and the summary's) and step times
count training only, on a clock the test moves."""

from __future__ import annotations

import types
from typing import Any

import pytest

from distrun.protocol import Step
from distrun.runtime import _reporter
from distrun.runtime._reporter import EventReporter

SAMPLES = 8  # a replica's samples a step
WORLD = 2


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now


class _Events:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def emit(self, event: object) -> None:
        self.sent.append(event)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(_reporter, "time", types.SimpleNamespace(monotonic=clock.monotonic, time=clock.time))
    return clock


def _reporter_on(events: _Events, interval_s: float = 0.0, total_steps: int = 6) -> EventReporter:
    writer: Any = events  # the reporter only calls emit()
    reporter = EventReporter(writer, rank=0, world_size=WORLD, interval_s=interval_s, device_type="cpu")
    reporter.total_steps = total_steps
    return reporter


def _steps(reporter: EventReporter, clock: _Clock, first: int, last: int, step_s: float = 1.0) -> None:
    for step in range(first, last + 1):
        reporter.step_started(step)
        clock.now += step_s
        reporter.step(step, epoch=0, loss=0.5, samples=SAMPLES)


def test_an_evaluation_between_steps_is_left_out_of_samples_per_s_and_of_the_next_steps_time(clock: _Clock) -> None:
    events = _Events()
    reporter = _reporter_on(events)
    _steps(reporter, clock, 1, 3)
    with reporter.outside_steps():  # a 10 s evaluation (the first one imports torchmetrics)
        clock.now += 10.0
    _steps(reporter, clock, 4, 5)
    # Steps 2-5 after step 1: four steps of 1 s. Counted, the evaluation would read 32 / 14 s.
    assert reporter.samples_per_s == pytest.approx(4 * SAMPLES * WORLD / 4.0)
    sent = [event for event in events.sent if isinstance(event, Step)]
    assert [event.step for event in sent] == [1, 2, 3, 4, 5]
    assert sent[3].step_ms == pytest.approx(1000.0)  # not 11,000
    assert sent[3].samples_per_s == pytest.approx(SAMPLES / 1.0)  # the window's rate, this replica's


def test_an_evaluation_after_the_last_step_changes_nothing_and_time_outside_still_counts_without_one(
        clock: _Clock) -> None:
    events = _Events()
    reporter = _reporter_on(events)
    _steps(reporter, clock, 1, 3)
    clock.now += 10.0  # a pause that is not an evaluation (a checkpoint, a slow batch) is the run's own
    _steps(reporter, clock, 4, 6)
    with_pause = 5 * SAMPLES * WORLD / 15.0
    assert reporter.samples_per_s == pytest.approx(with_pause)
    with reporter.outside_steps():  # the run's final evaluation
        clock.now += 30.0
    assert reporter.samples_per_s == pytest.approx(with_pause)


def test_time_outside_the_steps_before_step_1_is_not_subtracted_from_the_span(clock: _Clock) -> None:
    """Step 1's wall is warm-up and not in the span: an evaluation before it (a resumed run's) must
    not shorten the span of the steps after it."""
    events = _Events()
    reporter = _reporter_on(events)
    with reporter.outside_steps():
        clock.now += 5.0
    _steps(reporter, clock, 1, 3, step_s=2.0)
    assert reporter.samples_per_s == pytest.approx(2 * SAMPLES * WORLD / 4.0)



def test_a_window_of_unsent_steps_and_a_nested_block_leave_the_evaluation_out_once(clock: _Clock) -> None:
    """Step events every 5 s: the window holding the evaluation holds several steps too; an
    evaluation inside another block of time outside (its metrics' import) is counted once."""
    events = _Events()
    reporter = _reporter_on(events, interval_s=5.0, total_steps=12)
    _steps(reporter, clock, 1, 3)
    with reporter.outside_steps():
        clock.now += 2.0
        with reporter.outside_steps():
            clock.now += 8.0
    _steps(reporter, clock, 4, 12)
    sent = [event for event in events.sent if isinstance(event, Step)]
    assert [event.step for event in sent][0] == 1 and sent[-1].step == 12 and len(sent) < 12
    for event in sent[1:]:
        assert event.step_ms == pytest.approx(1000.0) and event.samples_per_s == pytest.approx(SAMPLES), event
    assert reporter.samples_per_s == pytest.approx(11 * SAMPLES * WORLD / 11.0)
