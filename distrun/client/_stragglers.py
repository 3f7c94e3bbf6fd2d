"""Naming slow ranks: whose compute time per step stays well above the others'.

Under a synchronous strategy every rank's step takes the same wall time, because the
gradients' all-reduce (or FSDP's gathers) waits for the slowest; what differs is how much of
the step each rank computed and how much it waited. Each rank reports its compute time per
step (``Step.compute_ms``: its step time less the wait its strategy measured), and this
compares them, the way Megatron's and NVIDIA's straggler detectors compare per-rank section
times, but from the client, so no collective is added to the job.

A rank is slow when its compute time stays above ``SLOW_RATIO`` times the median of the other
ranks' for ``SLOW_INTERVALS`` judgements in a row; a judgement is made each time every
running rank has reported a new figure (about once per ``--log-interval-s``). The median of
the *others*, not of all: with two ranks the median of both would hide a rank twice as slow
as its peer (1.33x). It stops being slow after as many judgements in a row under the ratio.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["StragglerWatch", "Verdict", "SLOW_RATIO", "SLOW_INTERVALS"]

#: A rank is slow above this many times the other ranks' median compute time...
SLOW_RATIO = 1.25
#: ...for this many judgements in a row (a checkpoint or a GC pause is one interval, not three).
SLOW_INTERVALS = 3


@dataclass(frozen=True)
class Verdict:
    """A change: ``rank`` became slow (or, ``recovered``, stopped being slow)."""

    rank: int
    ratio: float
    compute_ms: float
    median_ms: float
    intervals: int
    recovered: bool = False


class StragglerWatch:
    """Fed each rank's compute time as it comes; ``judge`` returns what changed."""

    def __init__(self, ratio: float = SLOW_RATIO, intervals: int = SLOW_INTERVALS) -> None:
        self.ratio = ratio
        self.intervals = intervals
        self._compute_ms: dict[int, float] = {}
        self._fresh: set[int] = set()
        self._above: dict[int, int] = {}
        self._below: dict[int, int] = {}
        self.slow: dict[int, float] = {}  # rank -> its newest ratio, while it is slow
        self.worst: dict[int, float] = {}  # rank -> its highest ratio while slow, over the run

    def observe(self, rank: int, compute_ms: float) -> None:
        self._compute_ms[rank] = compute_ms
        self._fresh.add(rank)

    def judge(self, ranks: Iterable[int]) -> list[Verdict]:
        """One judgement over ``ranks`` (the running ones), once each has a new figure.

        A rank no longer running is forgotten (a lost elastic replica is not slow for ever, and
        the replica restarted in its place starts its count afresh).
        """
        ranks = sorted(ranks)
        self._forget(set(ranks))
        if len(ranks) < 2 or not all(rank in self._fresh for rank in ranks):
            return []
        self._fresh.difference_update(ranks)
        ordered = sorted(self._compute_ms[rank] for rank in ranks)  # once: each rank's "others" drop one value
        verdicts = []
        for rank in ranks:
            median = _median_without(ordered, self._compute_ms[rank])
            if median <= 0:
                continue
            ratio = self._compute_ms[rank] / median
            if ratio > self.ratio:
                self._above[rank], self._below[rank] = self._above.get(rank, 0) + 1, 0
            else:
                self._below[rank], self._above[rank] = self._below.get(rank, 0) + 1, 0
            if rank in self.slow:
                if self._below[rank] >= self.intervals:
                    del self.slow[rank]
                    verdicts.append(Verdict(rank, ratio, self._compute_ms[rank], median, self._below[rank], True))
                else:
                    self.slow[rank] = ratio
                    self.worst[rank] = max(self.worst[rank], ratio)
            elif self._above[rank] >= self.intervals:
                self.slow[rank] = ratio
                self.worst[rank] = max(self.worst.get(rank, 0.0), ratio)
                verdicts.append(Verdict(rank, ratio, self._compute_ms[rank], median, self._above[rank]))
        return verdicts

    def _forget(self, running: set[int]) -> None:
        for table in (self._compute_ms, self._above, self._below, self.slow):
            for rank in [rank for rank in table if rank not in running]:
                del table[rank]
        self._fresh &= running


def _median_without(ordered: list[float], value: float) -> float:
    """The median of ``ordered`` (sorted) with one occurrence of ``value`` left out."""
    index = bisect.bisect_left(ordered, value)
    rest = ordered[:index] + ordered[index + 1:]
    return statistics.median(rest)
