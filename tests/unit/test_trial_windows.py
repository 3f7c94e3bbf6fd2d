"""A trial's step time: the mean step of the chief's Step events once warm (after their first
window), and the race's: the mean of every window, diloco's syncs included."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from distrun.cli._auto_trials import StepWindows, _step_s
from distrun.protocol import Step


def _step(step: int, step_ms: float | None, rank: int = 0) -> Step:
    return Step(rank=rank, time=float(step), step=step, epoch=0, loss=0.5, samples_per_s=1.0, mem_mb=1.0,
                step_ms=step_ms)


def _windows(*events: Step | None) -> StepWindows:
    windows = StepWindows()
    for event in events:
        windows.see(event)
    return windows


def test_the_first_window_warms_up_and_is_left_out_of_a_trials_figure() -> None:
    """A long step is its own window: steps 2-4 at 4.0, 1.4 and 1.2 s read 1.3, where all three read 2.2."""
    windows = _windows(_step(1, None), _step(2, 4000.0), None, _step(3, 1400.0), _step(4, 1200.0))
    assert windows.steady_s() == pytest.approx(1.3)
    assert windows.mean_s() == pytest.approx(6.6 / 3)


def test_windows_stand_for_their_steps_and_other_ranks_are_not_read() -> None:
    """A short step's windows hold many steps (the mean weighs each window by them), slow steps inside
    a later window count (a run pays for them); a window of rank 1 is not the chief's."""
    windows = _windows(_step(1, None), _step(3, 80.0), _step(1, None, rank=1), _step(13, 20.0),
                       _step(13, 900.0, rank=1), _step(16, 100.0))
    assert windows.windows == [(2, 0.08), (10, 0.02), (3, 0.1)]
    assert windows.steady_s() == pytest.approx((10 * 0.02 + 3 * 0.1) / 13)
    assert windows.mean_s() == pytest.approx((2 * 0.08 + 10 * 0.02 + 3 * 0.1) / 15)


def test_one_window_is_its_own_figure_and_none_is_no_figure() -> None:
    """A trial whose steps all fell in one window reads it; one that sent only step 1 falls back
    to the summary's mean (the caller's)."""
    assert _windows(_step(1, None), _step(9, 30.0)).steady_s() == pytest.approx(0.03)
    assert _windows(_step(1, None), None).steady_s() is None
    assert _windows(_step(1, None)).mean_s() is None


class _Job:
    """A finished trial as its events and outcome (the client's job objects give both)."""

    def __init__(self, events: list[Step | None], samples_per_s: float) -> None:
        self._events = events
        self._summary = SimpleNamespace(status="succeeded", samples_per_s=samples_per_s, error=None)

    def events(self) -> list[Step | None]:
        return self._events

    def cancel(self, reason: str) -> None:
        raise AssertionError(f"a trial within its deadline is not cancelled ({reason})")

    def outcome(self) -> SimpleNamespace:
        return SimpleNamespace(summary=self._summary)


def test_a_trials_figure_is_its_steady_windows_else_the_summarys_and_every_event_is_handed_on() -> None:
    spec: Any = SimpleNamespace(training=SimpleNamespace(global_batch_size=64))
    events = [_step(1, None), None, _step(2, 4000.0), _step(3, 1400.0), _step(4, 1200.0)]
    seen: list[Step | None] = []
    assert _step_s(_Job(events, samples_per_s=29.0), spec, time.perf_counter() + 60, seen.append) == pytest.approx(1.3)
    assert seen == events
    only_step_1 = _Job([_step(1, None)], samples_per_s=32.0)  # no window: the summary's 64 / 32
    assert _step_s(only_step_1, spec, time.perf_counter() + 60, lambda _: None) == pytest.approx(2.0)


def test_steps_far_faster_than_predicted_leave_one_step_after_the_first_window_and_all_are_read() -> None:
    """Steps 2-4 in one window (a throttled interval), step 5 alone: one step is no steady figure."""
    windows = _windows(_step(1, None), _step(4, 120.0), _step(5, 90.0))
    assert windows.steady_s() == pytest.approx((3 * 0.12 + 0.09) / 4)
