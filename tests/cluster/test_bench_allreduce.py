"""`distrun bench allreduce` on namespace hosts whose links are shaped with tc tbf.

Run by `pytest -m bench` (not the default suite), it runs 2 hosts x 2 slots at 200 Mbit/s: the report's shape, nccl-tests' busbw
arithmetic, and the raw TCP link probe reading the rate the link was shaped to. Speed
is not asserted. The documented figure (P3 in docs/performance.md) is the same test with

    DISTRUN_BENCH_HOSTS=4 DISTRUN_BENCH_SIZES=1,4,16,64 DISTRUN_BENCH_REPEATS=3 \\
        python3 -m pytest -m bench tests/cluster/test_bench_allreduce.py -s
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cluster.conftest import brought_up, lab_cli, shaped_lab

pytestmark = pytest.mark.bench


def test_bench_allreduce_reports_both_algorithms_against_the_measured_links(tmp_path: Path) -> None:
    hosts = int(os.environ.get("DISTRUN_BENCH_HOSTS", "2"))
    slots = int(os.environ.get("DISTRUN_BENCH_SLOTS", "2"))
    rate_mbit = float(os.environ.get("DISTRUN_BENCH_RATE_MBIT", "200"))
    sizes = os.environ.get("DISTRUN_BENCH_SIZES", "1,4")
    repeats = os.environ.get("DISTRUN_BENCH_REPEATS", "2")
    names = tuple(f"h{i + 1}" for i in range(hosts))
    with shaped_lab(tmp_path, names, rate_mbit=rate_mbit) as lab:
        roles = {name: {"roles": "[chief, worker]" if i == 0 else "[worker]", "slots": str(slots)}
                 for i, name in enumerate(names)}
        with brought_up(lab, roles, "allreduce") as cluster:
            result = lab_cli(lab, "bench", "allreduce", "--cluster", str(cluster), "--sizes-mb", sizes,
                             "--repeats", repeats, "--json", "--plot", str(tmp_path / "allreduce.png"), timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    n = hosts * slots
    assert report["world_size"] == n and report["hosts"] == hosts and report["ranks_per_host"] == [slots] * hosts
    size_list = [float(s) for s in sizes.split(",")]
    assert [(row["size_mb"], row["algorithm"]) for row in report["rows"]] == [
        (size, algorithm) for size in size_list for algorithm in ("flat", "hierarchical")]
    for row in report["rows"]:
        assert row["algbw_MBps"] > 0 and row["time_ms"] > 0
        assert abs(row["busbw_MBps"] - row["algbw_MBps"] * 2 * (n - 1) / n) < 1e-6 * row["busbw_MBps"]
        assert row["of_link"] == row["busbw_MBps"] / report["link_MBps_min"]
    # Every pair of hosts, lower to higher, each read as the rate it was shaped to.
    links = report["links"]
    assert [(link["from_host"], link["to_host"]) for link in links] == [
        (i, j) for i in range(hosts) for j in range(i + 1, hosts)]
    shaped_MBps = rate_mbit / 8
    for link in links:
        assert 0.6 * shaped_MBps < link["MBps"] < 1.15 * shaped_MBps, link
    assert report["link_MBps_min"] == min(link["MBps"] for link in links)
    assert (tmp_path / "allreduce.png").stat().st_size > 0
