"""Ctrl-C while a job is drained is never lost (cli/_run).

A CI run's `distrun attach` outlived its Ctrl-C by 30 s with its main thread still in the event
loop and every follower still reading: no detach had begun. A KeyboardInterrupt raised while a
finalizer runs is printed as "Exception ignored" and dropped; the drain now counts signals instead.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

from distrun.cli._run import _drain, _raise_interrupt


class _Job:
    """Yields a poll's ``None`` until cancelled (or 200 polls, so a lost interrupt fails, never hangs)."""

    def __init__(self) -> None:
        self.cancels: list[bool] = []

    def events(self, poll_s: float = 0.25) -> Iterator[None]:
        for _ in range(200):
            if self.cancels:
                return
            yield None

    def cancel(self, reason: str = "cancelled", *, interrupted: bool = False) -> None:
        self.cancels.append(interrupted)


class _SignalsWhenCollected:
    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        signal.raise_signal(self.signum)  # its handler runs here, inside the finalizer


def _drained_with_a_signal_in_a_finalizer(signum: int) -> _Job:
    job, sent = _Job(), []

    def handle(_event: None) -> None:
        if not sent:
            sent.append(signum)
            _SignalsWhenCollected(signum)  # dropped at once: its __del__ runs now

    _drain(job, handle)  # type: ignore[arg-type]
    return job


def test_ctrl_c_taken_inside_a_finalizer_still_stops_the_job() -> None:
    assert _drained_with_a_signal_in_a_finalizer(signal.SIGINT).cancels == [True]


def test_sigterm_is_taken_as_ctrl_c_and_the_handlers_are_given_back() -> None:
    """``run_job`` turns SIGTERM into a KeyboardInterrupt (a supervisor's stop is Ctrl-C); it is counted too."""
    term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        assert _drained_with_a_signal_in_a_finalizer(signal.SIGTERM).cancels == [True]
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    finally:
        signal.signal(signal.SIGTERM, term)


def test_an_ignored_sigint_stays_ignored() -> None:
    """A script started in the background (``python sweep.py &``) gets SIGINT ignored, and a user's
    own handler is theirs: only a handler that would have raised is replaced while a job drains."""
    job, seen = _Job(), []

    def handle(_event: None) -> None:
        if not seen:
            seen.append(signal.getsignal(signal.SIGINT))
            signal.raise_signal(signal.SIGINT)

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _drain(job, handle)  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen == [signal.SIG_IGN] and job.cancels == []


def test_a_second_ctrl_c_before_the_first_was_acted_on_breaks_out() -> None:
    """A main thread held outside the loop (a stdout nobody reads) would never act on a count: a
    second Ctrl-C raises, as every Ctrl-C did before, and the job is cancelled once for both."""
    job = _Job()

    def handle(_event: None) -> None:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # raises here
        raise AssertionError("the second Ctrl-C did not break out")

    _drain(job, handle)  # type: ignore[arg-type]
    assert job.cancels == [True]


def test_each_ctrl_c_is_acted_on_once() -> None:
    """Two Ctrl-C: the job is cancelled twice (the second while it winds down), not on every event after."""

    class _Slow(_Job):
        def events(self, poll_s: float = 0.25) -> Iterator[None]:
            for _ in range(20):
                yield None

    job, polls = _Slow(), []

    def handle(_event: None) -> None:
        polls.append(1)
        if len(polls) in (3, 7):
            signal.raise_signal(signal.SIGINT)

    _drain(job, handle)  # type: ignore[arg-type]
    assert job.cancels == [True, True]
