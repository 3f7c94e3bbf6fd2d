"""`distrun bench slowlinks` on two namespace hosts of one slot each.

Run by `pytest -m bench` (not the default suite), on unshaped links: it holds the report's shape,
that every contender trains and evaluates, and that diloco's hosts send fewer bytes per step
(they sync once every H steps). The documented figures (docs/performance.md) are the same test
on shaped links:

    DISTRUN_BENCH_RATE_MBIT=50 DISTRUN_BENCH_STEPS=100 python3 -m pytest -m bench tests/cluster/test_bench_slowlinks.py -s \
        -o timeout=3000
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.cluster.conftest import bench_on_two_hosts

pytestmark = pytest.mark.bench


def test_bench_slowlinks_compares_diloco_with_multi_worker(tmp_path: Path) -> None:
    report, steps = bench_on_two_hosts(tmp_path, "slowlinks", "20", timeout=3000)
    rows = {row["contender"]: row for row in report["rows"]}
    assert list(rows)[0] == "multi-worker" and len(rows) == 5
    for name, row in rows.items():
        assert row["steps"] == int(steps) and row["bytes_per_step"] > 0, (name, row)
        assert math.isfinite(row["eval_loss"]) and row["curve"][-1][2] == int(steps), (name, row)
    assert rows["diloco H=10"]["outer_steps"] == int(steps) // 10
    # A sync every 10 steps instead of an all-reduce every step: the goal is 5x fewer bytes.
    assert rows["diloco H=10"]["bytes_vs_baseline"] >= report["goals"]["bytes_vs_baseline_at_h10"], rows["diloco H=10"]
