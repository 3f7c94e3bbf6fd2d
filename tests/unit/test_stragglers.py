"""StragglerWatch: a rank is named when its compute time stays above 1.25x the others' median."""

from __future__ import annotations

from distrun.client._stragglers import SLOW_INTERVALS, SLOW_RATIO, StragglerWatch
from distrun.client._tracker import JobTracker
from distrun.protocol import Started, Step, Straggler


def judge_round(watch: StragglerWatch, figures: dict[int, float]):
    for rank, ms in figures.items():
        watch.observe(rank, ms)
    return watch.judge(figures)


def test_a_rank_is_named_only_after_three_slow_intervals_in_a_row():
    watch = StragglerWatch()
    assert SLOW_RATIO == 1.25 and SLOW_INTERVALS == 3
    assert judge_round(watch, {0: 10.0, 1: 20.0, 2: 10.0}) == []
    assert judge_round(watch, {0: 10.0, 1: 20.0, 2: 10.0}) == []
    [verdict] = judge_round(watch, {0: 10.0, 1: 20.0, 2: 10.0})
    assert (verdict.rank, verdict.ratio, verdict.median_ms, verdict.intervals, verdict.recovered) == (1, 2.0, 10.0, 3, False)
    assert watch.slow == {1: 2.0}
    assert judge_round(watch, {0: 10.0, 1: 30.0, 2: 10.0}) == []  # named once; its ratio is followed
    assert watch.slow == {1: 3.0} and watch.worst == {1: 3.0}


def test_one_fast_interval_starts_the_count_again():
    watch = StragglerWatch()
    judge_round(watch, {0: 10.0, 1: 20.0})
    judge_round(watch, {0: 10.0, 1: 20.0})
    assert judge_round(watch, {0: 10.0, 1: 11.0}) == []  # a GC pause or a checkpoint is not a straggler
    assert judge_round(watch, {0: 10.0, 1: 20.0}) == []
    assert judge_round(watch, {0: 10.0, 1: 20.0}) == []
    assert [v.rank for v in judge_round(watch, {0: 10.0, 1: 20.0})] == [1]


def test_the_threshold_is_strict_and_against_the_others_median():
    watch = StragglerWatch()
    for _ in range(5):  # exactly 1.25x is not above it
        assert judge_round(watch, {0: 8.0, 1: 10.0, 2: 8.0, 3: 8.0}) == []
    watch = StragglerWatch()
    for _ in range(2):  # with two ranks the median of both would be 1.33x here; the other's is 2x
        judge_round(watch, {0: 10.0, 1: 20.0})
    assert [v.rank for v in judge_round(watch, {0: 10.0, 1: 20.0})] == [1]


def test_a_rank_that_recovers_is_said_so_after_as_many_intervals():
    watch = StragglerWatch()
    for _ in range(3):
        judge_round(watch, {0: 10.0, 1: 30.0})
    assert judge_round(watch, {0: 10.0, 1: 10.0}) == []
    assert judge_round(watch, {0: 10.0, 1: 10.0}) == []
    [verdict] = judge_round(watch, {0: 10.0, 1: 10.0})
    assert (verdict.rank, verdict.recovered) == (1, True) and watch.slow == {} and watch.worst == {1: 3.0}


def test_no_judgement_until_every_running_rank_has_a_new_figure():
    watch = StragglerWatch()
    for _ in range(5):
        watch.observe(0, 10.0)
        watch.observe(1, 50.0)
        assert watch.judge([0, 1, 2]) == []  # rank 2 said nothing new
    assert watch.judge([0]) == []  # one rank: nothing to compare with


def test_the_tracker_makes_a_straggler_event_and_marks_the_row():
    tracker = JobTracker("r.py", "mirrored", 2, host_of_rank=lambda rank: f"10.0.0.{rank + 1}")
    for rank in (0, 1):
        tracker.update(Started(rank=rank, time=0.0, pid=1, device="cpu", world_size=2, recipe_kind="fit"))
    made = []
    for step in range(1, 5):
        for rank, ms in ((0, 10.0), (1, 25.0)):
            tracker.update(Step(rank=rank, time=float(step), step=step, epoch=0, loss=1.0, samples_per_s=1.0,
                                mem_mb=1.0, step_ms=30.0, compute_ms=ms))
            made += tracker.take_made()
    assert made == [Straggler(rank=1, time=3.0, host="10.0.0.2", ratio=2.5, compute_ms=25.0, median_ms=10.0,
                              intervals=3)]
    snapshot = tracker.snapshot()
    assert [row.slow for row in snapshot.rows] == [None, 2.5]
    assert snapshot.straggler_line and "rank 1 (10.0.0.2) 2.50x" in snapshot.straggler_line
    assert tracker.summary("succeeded").stragglers == {"1": 2.5}


def test_a_rank_that_stops_running_is_forgotten():
    watch = StragglerWatch()
    for _ in range(3):
        judge_round(watch, {0: 10.0, 1: 30.0, 2: 10.0})
    assert watch.slow == {1: 3.0}
    assert judge_round(watch, {0: 10.0, 2: 10.0}) == []  # rank 1 left (an elastic replica lost)
    assert watch.slow == {} and watch.worst == {1: 3.0}  # the summary still says it was slow
    for _ in range(2):  # a replica restarted as rank 1 starts its count afresh
        judge_round(watch, {0: 10.0, 1: 30.0, 2: 10.0})
    assert watch.slow == {}
