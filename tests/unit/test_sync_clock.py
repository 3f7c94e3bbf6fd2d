"""SyncClock and its span timers: what counts as a step's wait for peers, on the host and on a GPU stream.

The host path runs for real here (a model, an optimizer, FSDP2 on a one-rank gloo group).
The CUDA path's reading logic runs against a stand-in GPU timeline: this machine has no GPU;
tests/gpu/test_cuda.py times real CUDA streams.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distrun.strategies.step.span_timer import CudaTimer, HostTimer, timer_for
from distrun.strategies.step.sync_clock import SyncClock

# -- CudaTimer against a stand-in timeline --------------------------------------------------


class Timeline:
    """A GPU stream as the timer sees it: events recorded in order, passed when the GPU gets there."""

    def __init__(self) -> None:
        self.recorded = 0  # how many records were made
        self.passed = 0  # how many of them the GPU has run
        self.now_ms = 0.0
        self.times_ms: dict[int, float] = {}
        self.created = 0
        self.synchronized: list[int] = []

    def event(self) -> FakeEvent:
        self.created += 1
        return FakeEvent(self)

    def run(self, records: int, ms_each: float) -> None:
        """The GPU runs the next ``records`` records, ``ms_each`` apart."""
        for _ in range(records):
            self.now_ms += ms_each
            self.passed += 1
            self.times_ms[self.passed] = self.now_ms


class FakeEvent:
    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.position: int | None = None

    def record(self) -> None:
        self.timeline.recorded += 1
        self.position = self.timeline.recorded

    def query(self) -> bool:
        return self.position is not None and self.position <= self.timeline.passed

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an event the GPU has not passed"
        return self.timeline.times_ms[end.position] - self.timeline.times_ms[self.position]

    def synchronize(self) -> None:
        self.timeline.synchronized.append(self.position)
        self.timeline.run(self.position - self.timeline.passed, 1.0)


def test_a_gpu_span_is_read_only_once_the_gpu_has_passed_its_end():
    gpu = Timeline()
    timer = CudaTimer(new_event=gpu.event)
    timer.span(timer.mark())
    assert timer.take_s() == 0.0 and timer.pending == 1  # the CPU ran ahead: nothing known yet
    gpu.run(1, 5.0)  # the start passed, not the end
    assert timer.take_s() == 0.0
    gpu.run(1, 40.0)  # the stream stalled 40 ms between the two
    assert timer.take_s() == pytest.approx(0.040) and timer.pending == 0
    assert timer.take_s() == 0.0  # read once


def test_gpu_spans_are_read_oldest_first_and_events_are_reused():
    gpu = Timeline()
    timer = CudaTimer(new_event=gpu.event)
    for _ in range(3):
        timer.span(timer.mark())
    gpu.run(4, 10.0)  # the first two spans
    assert timer.take_s() == pytest.approx(0.020) and timer.pending == 1
    gpu.run(2, 10.0)
    assert timer.take_s() == pytest.approx(0.010)
    for _ in range(50):  # steady state: the pool, not new events
        timer.span(timer.mark())
        gpu.run(2, 1.0)
        timer.take_s()
    assert gpu.created <= 6


def test_a_reused_mark_moves_the_start_and_a_dropped_one_returns_to_the_pool():
    gpu = Timeline()
    timer = CudaTimer(new_event=gpu.event)
    ready = None
    for _ in range(5):  # each gradient's arrival moves the one start event
        ready = timer.mark(reuse=ready)
    assert gpu.created == 1
    timer.span(ready)
    gpu.run(5, 3.0)  # four superseded records, then the last start...
    gpu.run(1, 7.0)  # ...and the end, 7 ms after it
    assert timer.take_s() == pytest.approx(0.007)
    dropped = timer.mark()
    timer.drop(dropped)
    assert timer.mark() is dropped


def test_a_gpu_far_behind_is_waited_on_so_the_pending_spans_stay_bounded():
    gpu = Timeline()
    timer = CudaTimer(new_event=gpu.event, max_pending=4)
    for _ in range(4):
        timer.span(timer.mark())
    assert gpu.synchronized == []
    timer.span(timer.mark())  # the fifth: the oldest end is waited on, and read
    assert gpu.synchronized == [2] and timer.pending == 4
    for _ in range(20):  # nobody takes: still bounded
        timer.span(timer.mark())
    assert timer.pending == 4 and len(gpu.synchronized) == 21
    assert timer.take_s() == pytest.approx(0.021)  # what was read on the way is not lost


def test_discarded_gpu_spans_are_never_read_and_their_events_are_reused():
    gpu = Timeline()
    timer = CudaTimer(new_event=gpu.event)
    for _ in range(3):  # a step that raised, its spans still ahead of the GPU
        timer.span(timer.mark())
    timer.discard()
    assert timer.pending == 0
    gpu.run(6, 50.0)
    timer.span(timer.mark())
    gpu.run(2, 4.0)
    assert timer.take_s() == pytest.approx(0.004) and gpu.created == 6


def test_each_device_gets_its_timer():
    assert isinstance(timer_for(torch.device("cpu")), HostTimer)
    assert isinstance(timer_for(torch.device("cuda", 0)), CudaTimer)  # built lazily: no GPU needed here
    assert timer_for(torch.device("mps")) is None


# -- SyncClock on the host ---------------------------------------------------------------


def step(model: nn.Module, optimizer: torch.optim.Optimizer, between_s: float) -> None:
    model(torch.randn(4, 8)).sum().backward()
    time.sleep(between_s)  # what DDP's wait for the all-reduce looks like from here
    optimizer.step()
    optimizer.zero_grad()


def test_the_wait_runs_from_the_end_of_backward_to_the_optimizer_step_inside_a_step_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = SyncClock()
    clock.watch(model, optimizer, torch.device("cpu"))
    assert clock.measures
    clock.begin()
    step(model, optimizer, 0.1)
    assert clock.waited_s() == 0.0  # the first step after watch() is a warm-up
    step(model, optimizer, 0.2)  # outside a step (an evaluation): not a step's wait
    clock.begin()
    step(model, optimizer, 0.1)
    waited = clock.waited_s()
    assert 0.1 <= waited < 0.18
    clock.begin()
    step(model, optimizer, 0.0)
    assert clock.waited_s() < 0.05
    clock.begin()
    model(torch.randn(4, 8)).sum().backward()
    time.sleep(0.1)
    clock.discard()  # the step raised before its optimizer step
    clock.begin()
    for _ in range(2):  # two accumulated backwards: the wait starts at the end of the last
        model(torch.randn(4, 8)).sum().backward()
        time.sleep(0.1)
    optimizer.step()
    assert 0.1 <= clock.waited_s() < 0.18
    clock.close()
    assert not clock.measures
    clock.begin()
    step(model, optimizer, 0.1)
    assert clock.waited_s() == 0.0  # its hooks are gone


def test_a_backward_that_raised_leaves_the_next_step_timed():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = SyncClock()
    clock.watch(model, optimizer, torch.device("cpu"))
    clock.begin()
    step(model, optimizer, 0.0)
    clock.waited_s()  # the warm-up
    clock.begin()
    hidden = model[0](torch.randn(4, 8))
    hidden.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("a peer was lost")))
    with pytest.raises(RuntimeError, match="a peer was lost"):  # after the last layer's gradients arrived
        model[2](torch.relu(hidden)).sum().backward()
    clock.discard()
    optimizer.zero_grad()
    clock.begin()
    step(model, optimizer, 0.1)
    assert 0.1 <= clock.waited_s() < 0.18


def test_a_device_without_a_timer_measures_nothing():
    model = nn.Linear(8, 1)
    clock = SyncClock()
    clock.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("mps"))
    assert not clock.measures


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def slow(method, seconds: float):
    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return method(*args, **kwargs)

    return slowed


def test_fsdps_waits_count_once_even_when_one_runs_inside_another(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    from distrun.strategies.step.sync_clock import _fsdp_parts

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    groups, states = _fsdp_parts(model)
    assert len(groups) == 2 and len(states) == 3  # the root holds no parameters of its own
    for group in groups:  # finalize_backward runs inside the root's end-of-backward callback, also timed
        group.finalize_backward = slow(group.finalize_backward, 0.05)
        group.wait_for_unshard = slow(group.wait_for_unshard, 0.02)  # called in forward and again in backward
    clock = SyncClock()
    clock.watch(model, optimizer, torch.device("cpu"))
    assert clock.measures
    clock.begin()
    step(model, optimizer, 0.0)
    assert clock.waited_s() == 0.0  # the warm-up step
    clock.begin()
    step(model, optimizer, 0.0)
    waited = clock.waited_s()
    # 2 x 50 ms once and 4 x 20 ms: 0.18 s; the finalizes counted twice would be 0.28 s
    assert 0.18 <= waited < 0.26

    with torch.no_grad():  # an evaluation between steps gathers too (2 x 20 ms): not a step's wait
        model(torch.randn(4, 8))
    clock.begin()
    assert clock.waited_s() < 0.01
    clock.close()
    assert all(group.__dict__["finalize_backward"].__name__ == "slowed" for group in groups)  # theirs, not the clock's
