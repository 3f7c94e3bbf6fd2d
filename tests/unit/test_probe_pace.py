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
