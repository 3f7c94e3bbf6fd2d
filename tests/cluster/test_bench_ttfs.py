"""`distrun bench ttfs` and the scaling report on the two-host namespace cluster.

Speed is not asserted (figures go in docs/performance.md); this holds the
benchmark's shape and that its contenders really ran. DISTRUN_BENCH_REPEATS
raises the repeats for the documented figures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cluster.conftest import Lab, lab_cli

pytestmark = pytest.mark.bench


def test_ttfs_benchmark_reports_each_contender(lab: Lab, cluster: Path) -> None:
    repeats = os.environ.get("DISTRUN_BENCH_REPEATS", "1")
    result = lab_cli(lab, "bench", "ttfs", "--cluster", str(cluster), "--repeats", repeats, "--json", timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=2))
    assert report["world_size"] == 2 and report["repeats"] == int(repeats)
    names = [row["name"] for row in report["rows"]]
    assert names == ["torchrun (cold)", "distrun script (warm cluster)", "distrun fit (warm cluster)"]
    for row in report["rows"]:
        assert 0 < row["time_to_first_step_s"] < row["wall_s"] < 120
    assert report["rows"][0]["speedup_vs_torchrun"] == 1.0 and report["rows"][0]["wall_speedup_vs_torchrun"] == 1.0


def test_scaling_report_on_a_cluster(lab: Lab, cluster: Path) -> None:
    result = lab_cli(lab, "bench", "mlp", "--cluster", str(cluster), "--image-size", "16", "--batch", "2",
                     "--steps", "2", "--warmup", "1", "--json", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [row["replicas"] for row in report["rows"]] == [1, 2]  # one-device, then every worker host
    assert all(row["images_per_s"] > 0 for row in report["rows"])
