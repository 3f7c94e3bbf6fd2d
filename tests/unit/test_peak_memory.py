"""Each rank's peak memory: measured in the rank, carried by its events, kept at its highest, summed up per rank."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distrun.client._tracker import JobTracker
from distrun.protocol import Done, Started, Step
from distrun.strategies.sharding.allocator import fix_mmap_threshold


def _step(rank: int, peak: float | None) -> Step:
    return Step(rank=rank, time=1.0, step=1, epoch=0, loss=0.5, samples_per_s=1.0, mem_mb=10.0, peak_mem_mb=peak)


def test_the_summary_keeps_each_ranks_highest_peak() -> None:
    tracker = JobTracker("r.py", "sharded", 2, started_at=0.0)
    for event in (Started(rank=0, time=0.0, pid=1, device="cpu", world_size=2, recipe_kind="fit"),
                  Started(rank=1, time=0.0, pid=2, device="cpu", world_size=2, recipe_kind="fit"),
                  _step(0, 300.0), _step(1, 250.0), _step(0, 280.0),  # a later, lower figure does not lower it
                  Done(rank=0, time=2.0, steps=1, final_loss=0.5, samples_per_s=1.0, first_step_time=1.0,
                       peak_mem_mb=310.0),
                  Done(rank=1, time=2.0, steps=1, final_loss=0.5, samples_per_s=1.0, first_step_time=1.0)):
        tracker.update(event)
    assert tracker.summary("succeeded").peak_mem_mb == {"0": 310.0, "1": 250.0}


def test_the_peak_rss_grows_with_what_this_process_touched() -> None:
    """In a fresh interpreter, whose high-water mark is its own (this one's is the whole suite's)."""
    code = ("from distrun.runtime._reporter import peak_rss_mb\n"
            "before = peak_rss_mb()\n"
            "block = bytearray(64 * 2**20)\n"
            "block[::4096] = b'x' * len(block[::4096])\n"
            "print(before, peak_rss_mb())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after = map(float, done.stdout.split())
    assert before > 1 and after >= before + 60, (before, after)


def test_the_mmap_threshold_is_fixed_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fix_mmap_threshold() is True  # glibc, here and in CI
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    assert fix_mmap_threshold() is False
