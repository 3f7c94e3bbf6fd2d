"""`distrun bench auto --cluster` on two namespace hosts of one slot each.

Run by `pytest -m bench` (not the default suite): the memory-to-spare scenarios on the hosts'
own devices and memory, with the planner probing the link between them. It holds the report's
shape, that every contender and auto train there, and that auto's predicted peak is within the
issue's 25% of the measured one. Speed is not asserted. The documented figures
(docs/performance.md#strategy-auto) are this test on unshaped and on 200 Mbit/s links:

    DISTRUN_BENCH_RATE_MBIT=200 python3 -m pytest -m bench tests/cluster/test_bench_auto.py -s
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.conftest import bench_on_two_hosts

pytestmark = [pytest.mark.bench, pytest.mark.timeout(2400)]


def test_bench_auto_runs_every_contender_and_auto_on_the_cluster(tmp_path: Path) -> None:
    report, _steps = bench_on_two_hosts(tmp_path, "auto", "3", timeout=2400)
    assert report["cluster"] and len(report["rows"]) == 3, report
    for row in report["rows"]:
        policies = [(c["policy"], c["layout"]) for c in row["contenders"]]
        assert policies[0] == ("mirrored", "multi-worker x2") and policies[1] == ("sharded", "sharded x2"), policies
        assert policies[2][0] == "pipeline" and "--pp 2" in policies[2][1], policies
        assert policies[-1][0] == "auto" and policies[-1][1].startswith("auto: "), policies
        assert all(c["exit"] == 0 and c["samples_per_s"] > 0 for c in row["contenders"]), row["contenders"]
        auto = row["contenders"][-1]
        assert auto["plan"]["links"]["from"] in ("timed", "kept"), auto["plan"]["links"]  # the hosts' link, measured
        assert abs(auto["predicted_peak_mb"] - auto["peak_mb"]) <= 0.25 * auto["peak_mb"], auto
        assert row["vs_best"] > 0 and row["cgroup_limit_mb"] is None
