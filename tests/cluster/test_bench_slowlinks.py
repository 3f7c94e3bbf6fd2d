"""`distrun bench slowlinks` on two namespace hosts of one slot each.

Run by `pytest -m bench` (not the default suite), on unshaped links: it holds the report's shape,
that every contender trains and evaluates, and that diloco's hosts send fewer bytes per step
(they sync once every H steps). The documented figures (docs/performance.md) are the same test
on shaped links:

    DISTRUN_BENCH_RATE_MBIT=50 DISTRUN_BENCH_STEPS=100 python3 -m pytest -m bench tests/cluster/test_bench_slowlinks.py -s \
        -o timeout=3000
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.cluster.conftest import brought_up, lab_cli, shaped_lab

pytestmark = pytest.mark.bench


def test_bench_slowlinks_compares_diloco_with_multi_worker(tmp_path: Path) -> None:
    rate = os.environ.get("DISTRUN_BENCH_RATE_MBIT")
    steps = os.environ.get("DISTRUN_BENCH_STEPS", "20")
    with shaped_lab(tmp_path, ("h1", "h2"), rate_mbit=float(rate) if rate else None) as lab:
        roles = {"h1": {"roles": "[chief, worker]"}, "h2": {"roles": "[worker]"}}
        with brought_up(lab, roles, "slowlinks") as cluster:
            result = lab_cli(lab, "bench", "slowlinks", "--cluster", str(cluster), "--steps", steps, "--json",
                             timeout=3000)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps({**report, "rows": [{k: v for k, v in row.items() if k != "curve"} for row in report["rows"]]},
                     indent=1))
    rows = {row["contender"]: row for row in report["rows"]}
    assert list(rows)[0] == "multi-worker" and len(rows) == 5
    for name, row in rows.items():
        assert row["steps"] == int(steps) and row["bytes_per_step"] > 0, (name, row)
        assert math.isfinite(row["eval_loss"]) and row["curve"][-1][2] == int(steps), (name, row)
    assert rows["diloco H=10"]["outer_steps"] == int(steps) // 10
    # A sync every 10 steps instead of an all-reduce every step: the goal is 5x fewer bytes.
    assert rows["diloco H=10"]["bytes_vs_baseline"] >= report["goals"]["bytes_vs_baseline_at_h10"], rows["diloco H=10"]
