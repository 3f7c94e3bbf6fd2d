"""`distrun bench compression` on two namespace hosts of one slot each.

Run by `pytest -m bench` (not the default suite), it runs on unshaped links and holds the report's shape and that every
compression trains (digits accuracy, a falling loss). Speed is not asserted. The
documented figure (P5 in docs/performance.md) is the same test on 50 Mbit/s links:

    DISTRUN_BENCH_RATE_MBIT=50 python3 -m pytest -m bench tests/cluster/test_bench_compression.py -s
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.cluster.conftest import bench_on_two_hosts

pytestmark = pytest.mark.bench


def test_bench_compression_trains_the_workload_and_digits_under_each_compression(tmp_path: Path) -> None:
    report, steps = bench_on_two_hosts(tmp_path, "compression", "5")
    assert report["world_size"] == 2 and report["timed_steps"] == int(steps)
    assert report["parameters"] == 256 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    rows = {row["compression"]: row for row in report["rows"]}
    assert list(rows) == ["none", "fp16", "bf16", "powersgd:2"]
    assert rows["none"]["speedup_vs_none"] == 1.0
    for name, row in rows.items():
        assert row["samples_per_s"] > 0, name
        # 10 classes: a model that learned nothing sits at ln 10 = 2.30.
        assert math.isfinite(row["loss"]) and row["loss"] < math.log(10), (name, row)
        assert row["digits_accuracy"] > 0.9, (name, row)
