"""`distrun bench auto` on its small scenario (`pytest -m bench`; not the default suite).

The report's shape, and what must hold whatever the machine: every contender of the scenario runs
(mirrored, sharded, the best pipeline, and auto itself), auto reports the plan it ran, and its
predicted peak is within 25% of the measured one. The documented figures (docs/performance.md)
are the full run's, every scenario as root.
"""

from __future__ import annotations

import pytest

from distrun.bench.auto import SCENARIOS, run_auto

pytestmark = pytest.mark.bench


def test_bench_auto_runs_every_contender_and_auto_on_the_small_scenario():
    report = run_auto(steps=2, scenarios=SCENARIOS[:1])
    (row,) = report["rows"]
    layouts = [c["layout"] for c in row["contenders"]]
    assert layouts[:2] == ["mirrored x2", "sharded x2"] and "--pp 2" in layouts[2], layouts
    assert layouts[-1].startswith("auto: "), layouts
    assert all(c["exit"] == 0 and c["samples_per_s"] > 0 for c in row["contenders"]), row["contenders"]
    auto = row["contenders"][-1]
    assert auto["plan"]["chosen"]["strategy"]["replicas"] >= 1 and auto["decide_s"] <= 30
    assert abs(auto["predicted_peak_mb"] - auto["peak_mb"]) <= 0.25 * auto["peak_mb"], auto
    assert report["geomean_vs_best"] == row["vs_best"] > 0
