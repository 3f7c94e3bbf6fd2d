"""A trial's step time: the median step of the chief's Step events, so that one slow step of a short
trial does not become the plan's predicted step."""

from __future__ import annotations

import pytest

from distrun.cli._auto_trials import StepWindows
from distrun.protocol import Step


def _step(step: int, step_ms: float | None, rank: int = 0) -> Step:
    return Step(rank=rank, time=float(step), step=step, epoch=0, loss=0.5, samples_per_s=1.0, mem_mb=1.0,
                step_ms=step_ms)


def _windows(*events: Step | None) -> StepWindows:
    windows = StepWindows()
    for event in events:
        windows.see(event)
    return windows


def test_one_slow_step_of_three_does_not_move_the_figure() -> None:
    """A long step is its own window: steps 2-4 at 4.0, 1.4 and 1.3 s read 1.4, where their mean is 2.23."""
    windows = _windows(_step(1, None), _step(2, 4000.0), None, _step(3, 1400.0), _step(4, 1300.0))
    assert windows.median_s() == pytest.approx(1.4)


def test_windows_stand_for_their_steps_and_other_ranks_are_not_read() -> None:
    """A short step's windows hold many steps: the first window after warm-up holds 2 slow steps, the
    next two 10 each; a window of rank 1 (slower, or not) is not the chief's."""
    windows = _windows(_step(1, None), _step(3, 80.0), _step(1, None, rank=1), _step(13, 20.0),
                       _step(13, 900.0, rank=1), _step(23, 22.0))
    assert windows.windows == [(2, 0.08), (10, 0.02), (10, 0.022)]
    assert windows.median_s() == pytest.approx(0.022)  # the median step: the 11th of 22 lies in a 22 ms window


def test_no_window_is_no_figure() -> None:
    """Only step 1 was sent (a trial of one step): the caller falls back to the summary's mean."""
    assert _windows(_step(1, None), None).median_s() is None
