"""`distrun bench layouts` end to end on small sizes (`pytest -m bench`; not the default suite).

The report's shape, and what must hold whatever the machine: every layout trains the same
batches to one loss, and keeping less for backward (activation checkpointing) never raises
a rank's peak where activations set it (sharded). The documented figures
(docs/performance.md) are the defaults'.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.bench


def test_bench_layouts_reports_each_layout_against_sharded():
    result = run_cli("bench", "layouts", "--steps", "2", "--json", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    rows = {row["layout"]: row for row in report["rows"]}
    assert len(rows) == 7 and rows["sharded x2"]["vs_sharded"] == 1.0
    losses = [row["final_loss"] for row in rows.values()]
    assert max(losses) - min(losses) < 1e-3, losses
    # Sharded's peak is its activations (no DDP buckets): keeping fewer of them lowers it (0.72x here).
    assert rows["sharded x2, checkpointing full"]["peak_mb"] < rows["sharded x2"]["peak_mb"]
