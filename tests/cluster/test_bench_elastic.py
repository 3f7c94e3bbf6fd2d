"""`distrun bench elastic` on three namespace hosts of one slot each.

Run by `pytest -m bench` (not the default suite), it holds the report's shape and that each contender recovered the way it says:
elastic with no restart and no step lost, the restart path with one restart from its
checkpoint. Speed is not asserted. The documented figure (docs/performance.md) is this
test's output:

    python3 -m pytest -m bench tests/cluster/test_bench_elastic.py -s
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster.conftest import brought_up, lab_cli, shaped_lab

pytestmark = pytest.mark.bench


def test_bench_elastic_times_both_recoveries_in_one_run(tmp_path: Path) -> None:
    with shaped_lab(tmp_path, ("h1", "h2", "h3")) as lab:
        roles = {"h1": {"roles": "[chief, worker]"}, "h2": {"roles": "[worker]"}, "h3": {"roles": "[worker]"}}
        with brought_up(lab, roles, "bench-elastic") as cluster:
            result = lab_cli(lab, "bench", "elastic", "--cluster", str(cluster), "--json", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    assert report["hosts"] == 3 and report["kill_at"] == 30
    elastic, restart = report["rows"]
    assert elastic["contender"] == "elastic" and restart["contender"] == "restart"
    assert elastic["restarts"] == 0 and elastic["steps_lost"] == 0 and elastic["membership_changes"] >= 1
    assert elastic["steps_redone"] == 0  # it went on from the step that failed
    assert restart["restarts"] == 1 and restart["membership_changes"] == 0
    assert restart["steps_redone"] == 29 - 20  # back to the checkpoint of step 20
    for row in (elastic, restart):
        assert 0 < row["recovery_s"] <= row["back_s"], row
    assert report["speedup"] == restart["recovery_s"] / elastic["recovery_s"]
    assert report["speedup_back"] == restart["back_s"] / elastic["back_s"]
