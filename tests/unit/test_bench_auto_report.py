"""`bench auto`'s report from its runs: which contenders it picks from a plan (here and on a
cluster, where replicated is multi-worker), and auto's ratios, with the 90% rule's reading."""

from __future__ import annotations

from distrun.bench.auto import SCENARIOS, _contenders, _flags, _row


def _candidate(layout: str, replicas: int, step_s: float, verdict: str = "slower", **flags: object) -> dict:
    strategy = layout.split(" ")[0]
    return {"layout": layout, "predicted_peak_mb": 500.0, "predicted_step_s": step_s, "verdict": verdict,
            "flags": {"strategy": strategy, "replicas": replicas, **flags}}


def test_on_a_cluster_the_policies_are_multi_worker_and_sharded_over_every_rank() -> None:
    plan = {"candidates": [
        _candidate("multi-worker --pp 2 (1f1b, 4 mb)", 1, 0.2, pp=2, pp_schedule="1f1b", microbatches=4),
        _candidate("multi-worker x2 --accumulate 2", 2, 0.25, accumulate=2),
        _candidate("multi-worker x2", 2, 0.3, verdict="chosen"),
        _candidate("sharded x2", 2, 0.4),
        _candidate("sharded x1", 1, 0.5),
        _candidate("multi-worker --pp 2 (gpipe, 2 mb)", 1, 0.1, verdict="needs 900 MB a rank, over ...",
                   pp=2, pp_schedule="gpipe", microbatches=2),
    ]}
    picked = [(policy, candidate["layout"]) for policy, candidate in _contenders(plan)]
    # The pipeline that fits and is fastest, not the faster one that does not fit.
    assert picked == [("mirrored", "multi-worker x2"), ("sharded", "sharded x2"),
                      ("pipeline", "multi-worker --pp 2 (1f1b, 4 mb)")]
    assert _flags(plan["candidates"][0]["flags"], None)[:4] == ["-s", "multi-worker", "--replicas", "1"]
    assert "--replicas" not in _flags(plan["candidates"][0]["flags"], object())  # a cluster's hosts run their slots


def _run(policy: str, rate: float, cgroup_peak_mb: float | None, exit_code: int = 0) -> dict:
    return {"policy": policy, "layout": policy, "samples_per_s": rate, "exit": exit_code,
            "cgroup_peak_mb": cgroup_peak_mb}


def test_a_run_over_90_percent_of_its_cgroup_is_shown_but_not_counted_best() -> None:
    runs = [_run("mirrored", 1338.0, 1480.0), _run("sharded", 585.0, 1100.0), _run("pipeline", 879.0, 1200.0),
            _run("auto", 813.0, 1210.0)]
    row = _row(SCENARIOS[3], {"budget_mb": 690.0}, runs, 1494.0)
    assert round(row["vs_best"], 2) == 0.61  # against mirrored, which ran at 99% of the limit
    assert round(row["vs_best_within_rule"], 2) == round(813 / 879, 2)  # against the best pipeline
    assert [c["within_rule"] for c in row["contenders"]] == [False, True, True, True]
    assert row["cgroup_limit_mb"] == 1494.0 and round(row["vs_mirrored"], 2) == 0.61


def test_without_a_cgroup_every_run_that_ended_is_within_the_rule() -> None:
    runs = [_run("mirrored", 0.0, None, exit_code=4), _run("sharded", 9.0, None), _run("pipeline", 14.0, None),
            _run("auto", 20.0, None)]
    row = _row(SCENARIOS[0], {"budget_mb": None}, runs, None)
    assert row["vs_best"] == row["vs_best_within_rule"] == 1.0
    assert row["vs_mirrored"] is None and [c["within_rule"] for c in row["contenders"]] == [False, True, True, True]
