"""`distrun bench pipeline` on two namespace hosts of one slot each.

Run by `pytest -m bench` (not the default suite), on unshaped links: it holds the report's
shape and that every contender trains. Speed is not asserted. The documented figures
(docs/performance.md) are the same test on 100 Mbit/s links:

    DISTRUN_BENCH_RATE_MBIT=100 python3 -m pytest -m bench tests/cluster/test_bench_pipeline.py -s
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.cluster.conftest import bench_on_two_hosts

pytestmark = pytest.mark.bench


def test_bench_pipeline_runs_each_contender_on_the_same_batches(tmp_path: Path) -> None:
    report, steps = bench_on_two_hosts(tmp_path, "pipeline", "4")
    rows = {row["contender"]: row for row in report["rows"]}
    assert list(rows) == ["multi-worker", "sharded", "multi-worker --pp 2"]
    assert rows["sharded"]["vs_sharded"] == 1.0
    assert rows["multi-worker --pp 2"]["mesh"] == {"dp": 1, "tp": 1, "pp": 2}
    for name, row in rows.items():
        assert row["samples_per_s"] > 0 and row["ranks"] == 2, (name, row)
        assert math.isfinite(row["final_loss"]), (name, row)
    # The same batches and the same updates: every layout ends at one loss.
    losses = [row["final_loss"] for row in rows.values()]
    assert max(losses) - min(losses) < 1e-3, losses
