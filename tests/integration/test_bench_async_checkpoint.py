"""What a save costs training, synchronous against `--async-checkpoint`, in one run (`pytest -m bench`).

The figures of docs/performance.md ("Checkpoint blocking"): the 50.4M-parameter model of
tests/integration/scripts/big_checkpoint.py, sharded over 2 CPU ranks, a checkpoint every 2
steps. Each case trains the recipe synchronously, then with `--async-checkpoint`, reads every
`checkpoint` event's `blocked_ms` and prints the means' ratio (async / synchronous):

    python3 -m pytest -m bench tests/integration/test_bench_async_checkpoint.py -s

Two cases: `eval` (the recipe has `eval_data`: the last save is written behind the run's
evaluation) and `no-eval` (the last save has nothing to hide behind). DISTRUN_BENCH_STEPS sets
the steps (12: six saves; 20 and 24 for ten and twelve), DISTRUN_BENCH_REPEATS the synchronous
and async pairs (1). Speed is asserted only where the feature stands or falls: with an
evaluation to write behind, async blocks less than synchronous.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

import pytest

from tests.conftest import REPO, CliResult, run_cli

pytestmark = [pytest.mark.bench, pytest.mark.timeout(3600)]

RECIPE = REPO / "tests" / "integration" / "scripts" / "big_checkpoint.py"


def _train(ckpt: Path, steps: int, every: int, asynchronous: bool, evaluate: bool) -> CliResult:
    args = ["train", str(RECIPE), "-s", "sharded", "--replicas", "2", "--steps", str(steps),
            "--checkpoint-every", str(every), "--checkpoint-dir", str(ckpt), "--json"]
    if asynchronous:
        args.append("--async-checkpoint")
    if evaluate:
        args += ["--", "--eval"]
    result = run_cli(*args, timeout=1200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("case", ["eval", "no-eval"])
def test_async_checkpoint_blocks_a_fraction_of_a_synchronous_save(tmp_path: Path, case: str) -> None:
    steps = int(os.environ.get("DISTRUN_BENCH_STEPS", "12"))
    repeats = int(os.environ.get("DISTRUN_BENCH_REPEATS", "1"))
    every = 2
    rows = []
    for repeat in range(repeats):
        pair = {}
        for mode in ("synchronous", "async"):
            ckpt = tmp_path / f"{mode}-{repeat}"
            run = _train(ckpt, steps, every, mode == "async", case == "eval")
            shutil.rmtree(ckpt)  # 604 MB a checkpoint
            blocked = [line["blocked_ms"] for line in run.json_lines() if line["type"] == "checkpoint"]
            steps_saved = [line["step"] for line in run.json_lines() if line["type"] == "checkpoint"]
            assert steps_saved == list(range(every, steps + 1, every)), steps_saved  # every save counts
            pair[mode] = {"blocked_ms": [round(ms) for ms in blocked], "mean_ms": round(statistics.fmean(blocked), 1),
                          "wall_s": round(run.summary["wall_s"], 1)}
        pair["ratio"] = round(pair["async"]["mean_ms"] / pair["synchronous"]["mean_ms"], 3)
        rows.append(pair)
    report = {"case": case, "steps": steps, "saves": steps // every, "cpus": os.cpu_count(), "rows": rows}
    print(json.dumps(report, indent=1))
    for pair in rows:
        print(f"{case}, {report['saves']} saves: async blocks {pair['ratio']}x as long as synchronous "
              f"(mean {pair['async']['mean_ms']} ms against {pair['synchronous']['mean_ms']} ms)")
        assert pair["ratio"] > 0
        if case == "eval":
            assert pair["ratio"] < 1, pair
