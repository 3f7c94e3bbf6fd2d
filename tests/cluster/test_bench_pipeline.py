"""`distrun bench pipeline` on two namespace hosts of one slot each.

Run by `pytest -m bench` (not the default suite), on unshaped links: it holds the report's
shape and that every contender trains. Speed is not asserted. The documented figures
(docs/performance.md) are the same test on 100 Mbit/s links:

    DISTRUN_BENCH_RATE_MBIT=100 python3 -m pytest -m bench tests/cluster/test_bench_pipeline.py -s
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.cluster.conftest import brought_up, lab_cli, shaped_lab

pytestmark = pytest.mark.bench


def test_bench_pipeline_runs_each_contender_on_the_same_batches(tmp_path: Path) -> None:
    rate = os.environ.get("DISTRUN_BENCH_RATE_MBIT")
    steps = os.environ.get("DISTRUN_BENCH_STEPS", "4")
    with shaped_lab(tmp_path, ("h1", "h2"), rate_mbit=float(rate) if rate else None) as lab:
        roles = {"h1": {"roles": "[chief, worker]"}, "h2": {"roles": "[worker]"}}
        with brought_up(lab, roles, "pipeline") as cluster:
            result = lab_cli(lab, "bench", "pipeline", "--cluster", str(cluster), "--steps", steps, "--json",
                             timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
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
