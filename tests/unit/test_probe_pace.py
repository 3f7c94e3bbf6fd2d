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
    """A machine that steps at one pace, then at twice that from its ``flip_at``-th run on: the two
    paces of this project's 2-core machine. A forward and backward of ``rows`` takes
    ``fixed + per_row * rows`` at the fast pace; the clock is the machine's own."""

    fixed, per_row = 0.05, 0.004

    def __init__(self, flip_at: int) -> None:
        self.flip_at, self.runs, self.now = flip_at, 0, 0.0

    def clock(self) -> float:
        return self.now

    def step(self, rows: int):
        def run() -> None:
            self.runs += 1
            pace = 2.0 if self.runs >= self.flip_at else 1.0
            self.now += pace * (self.fixed + self.per_row * rows)
        return run


def test_a_change_of_pace_never_reads_as_a_small_fixed_part(monkeypatch) -> None:
    """Timed in two blocks, a small batch read at the fast pace and a large one at the slow pace gave
    the 34M model's fixed part at 0.009 s against 0.05-0.14 s: each (small, large) pair is now read
    back to back, and a pair that straddles the change is outvoted. Wherever the pace changes, the
    fixed part read is one of the two paces' (0.05 s or 0.10 s), never a fraction of it."""
    import torch

    from distrun.planner import probe

    for flip_at in range(1, 10):
        machine = _Machine(flip_at)
        monkeypatch.setattr(probe.time, "perf_counter", machine.clock)
        pairs = probe._timed_pairs(machine.step(2), machine.step(8), torch.device("cpu"), lambda: None,
                                   lambda seconds: seconds)
        monkeypatch.undo()
        per_sample, fixed = probe.line_through(pairs, 2, 8)
        assert any(abs(fixed - pace * machine.fixed) < 1e-9 for pace in (1.0, 2.0)), (flip_at, pairs, fixed)
        assert any(abs(per_sample - pace * machine.per_row) < 1e-9 for pace in (1.0, 2.0)), (flip_at, pairs)

