"""`distrun bench embeddings` end to end on a small table (`pytest -m bench`; not the default suite).

What must hold whatever the machine: both contenders train the same batches to one loss
(SGD row-wise: the hybrid equals mirrored), and ``--embeddings ps`` moves fewer bytes a step
than mirrored, which all-reduces the whole table. The documented figures
(docs/performance.md) are the defaults' (1M rows).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.bench

ROWS, DIM, BATCH = 50_000, 32, 512


def test_bench_embeddings_ps_moves_fewer_bytes_than_mirrored() -> None:
    result = run_cli("bench", "embeddings", "--table-rows", str(ROWS), "--steps", "5", "--json", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    mirrored, ps = report["rows"]
    assert mirrored["contender"] == "mirrored x2" and ps["contender"] == "--embeddings ps"
    assert mirrored["table_bytes_per_step"] == ROWS * DIM * 4  # the whole table's gradient, every step
    # Each replica's half batch (256 ids of 50,000) pulls and pushes at most 256 rows of 128 bytes.
    assert 0 < ps["table_bytes_per_step"] <= 2 * (BATCH // 2) * DIM * 4
    assert ps["dense_grad_bytes_per_step"] == mirrored["dense_grad_bytes_per_step"] == report["dense_parameters"] * 4
    assert ps["bytes_per_step"] < mirrored["bytes_per_step"]
    assert report["ps_vs_mirrored"]["bytes_per_step"] == pytest.approx(ps["bytes_per_step"] / mirrored["bytes_per_step"])
    assert abs(ps["final_loss"] - mirrored["final_loss"]) < 1e-5  # the same training, moved differently
    assert ps["samples_per_s"] > 0 and mirrored["samples_per_s"] > 0


def test_bench_embeddings_refuses_a_table_of_no_rows_in_one_line() -> None:
    result = run_cli("bench", "embeddings", "--table-rows", "0")
    assert result.returncode == 2 and "--table-rows" in result.stderr and "Traceback" not in result.stderr, result.stderr
