"""The probe times each run at its slowest process's pace, as a synchronous step goes.

On this project's 2-core machine each of the probe's two processes read the 34M-parameter MLP's
1-row forward and backward at 0.05-0.07 s or at 0.13-0.15 s, and the first process's reading alone
put the fixed part a microbatch anywhere from 0.013 to 0.120 s between runs
(docs/performance.md#strategy-auto). Here, over a real gloo group of two processes, one process's
step is slow and the other's fast: both must read the slow one.
"""

from __future__ import annotations

import datetime
import time


def _ranks(rank: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from distrun.planner.probe import _timed
    from distrun.runtime._probe_recipe import slowest_of

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    cpu = torch.device("cpu")
    pace = 0.3 if rank == 1 else 0.01
    paced = _timed(lambda: time.sleep(pace), cpu, dist.barrier, lambda seconds: slowest_of(seconds, cpu))
    alone = _timed(lambda: time.sleep(pace), cpu, dist.barrier)  # each process's own reading
    with open(f"{out}.{rank}", "w") as handle:
        handle.write(f"{paced} {alone}")
    dist.destroy_process_group()


def test_each_run_is_read_at_the_slowest_processs_pace(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ranks, args=(str(tmp_path / "store"), str(tmp_path / "seconds")), nprocs=2, join=True)
    readings = [tuple(map(float, (tmp_path / f"seconds.{rank}").read_text().split())) for rank in (0, 1)]
    (paced_fast, alone_fast), (paced_slow, alone_slow) = readings
    assert alone_fast < 0.2 <= alone_slow, readings  # without it, the fast process reads its own pace
    assert paced_fast >= 0.3 and paced_slow >= 0.3, readings  # with it, both read the slow one's


class _Machine:
    """A machine that steps at one pace, then at the other from its ``flip_at``-th run on: the two
    paces of this project's 2-core machine (``slow_first``: the slow one first). A forward and
    backward of ``rows`` takes ``fixed + per_row * rows`` at the fast pace, twice that at the slow
    one; the clock is the machine's own."""

    fixed, per_row = 0.05, 0.004

    def __init__(self, flip_at: int, *, slow_first: bool) -> None:
        self.flip_at, self.slow_first, self.runs, self.now = flip_at, slow_first, 0, 0.0

    def clock(self) -> float:
        return self.now

    def step(self, rows: int):
        def run() -> None:
            self.runs += 1
            slow = (self.runs >= self.flip_at) != self.slow_first
            self.now += (2.0 if slow else 1.0) * (self.fixed + self.per_row * rows)
        return run


def test_a_change_of_pace_never_reads_as_a_small_fixed_part(monkeypatch) -> None:
    """Timed in two blocks, a small batch read at the fast pace and a large one at the slow pace gave
    the 34M model's fixed part at 0.0-0.026 s against 0.047-0.118 s: each (small, large) pair is now
    read back to back, and a pair that straddles the change is outvoted. Wherever the pace changes,
    either way, the line read is one pace's own (its slope and its fixed part alike), never a
    fraction of it; every process lines up and reads the slowest once a timed run (6 runs)."""
    from types import SimpleNamespace

    import torch

    from distrun.planner import probe

    for slow_first in (False, True):
        for flip_at in range(1, 10):
            machine, calls = _Machine(flip_at, slow_first=slow_first), {"together": 0, "slowest": 0}

            def together() -> None:
                calls["together"] += 1

            def slowest(seconds: float) -> float:
                calls["slowest"] += 1
                return seconds

            with monkeypatch.context() as patch:
                patch.setattr(probe, "time", SimpleNamespace(perf_counter=machine.clock))
                pairs = probe._timed_pairs(machine.step(2), machine.step(8), torch.device("cpu"), together, slowest)
            per_sample, fixed = probe.line_through(pairs, 2, 8)
            paces = [pace for pace in (1.0, 2.0) if abs(fixed - pace * machine.fixed) < 1e-9
                     and abs(per_sample - pace * machine.per_row) < 1e-9]
            assert paces, (slow_first, flip_at, pairs, per_sample, fixed)
            assert calls == {"together": 6, "slowest": 6}, calls
