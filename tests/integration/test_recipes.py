"""The recipes in recipes/ run under distrun as documented."""

import pytest

from tests.conftest import RECIPES, run_cli

pytestmark = pytest.mark.integration


def test_digits_classifier_learns_under_mirrored():
    result = run_cli("train", str(RECIPES / "digits.py"), "-s", "mirrored", "--replicas", "2", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = result.summary
    assert summary["eval_metrics"]["accuracy"] > 0.9
    evals = [e for e in result.json_lines() if e["type"] == "eval"]
    assert len(evals) == 10  # one per epoch (defaults: 10 epochs)


def test_linear_recipe_learns_the_line():
    result = run_cli("train", str(RECIPES / "linear.py"), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.summary["eval_metrics"]["loss"] < 1e-3


def test_json_stream_has_steps_and_a_complete_summary():
    result = run_cli("train", str(RECIPES / "linear.py"), "-s", "central-storage", "--replicas", "2",
                     "--steps", "30", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.json_lines()
    steps = [e for e in lines if e["type"] == "step"]
    assert {e["rank"] for e in steps} == {0, 1}
    assert all(isinstance(e["step"], int) and isinstance(e["loss"], float) for e in steps)
    assert max(e["step"] for e in steps) == 30
    summary = result.summary
    for key in ("status", "steps", "final_loss", "samples_per_s", "time_to_first_step_s", "wall_s"):
        assert key in summary
    assert summary["status"] == "succeeded" and summary["steps"] == 30
    assert summary["samples_per_s"] > 0 and 0 < summary["time_to_first_step_s"] < summary["wall_s"]


def test_custom_loop_runs_and_relays_output_with_the_rank():
    result = run_cli("train", str(RECIPES / "custom_loop.py"), "-s", "mirrored", "--replicas", "2", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.json_lines()
    printed = [e for e in lines if e["type"] == "output" and "mean loss" in e["line"]]
    assert [e["rank"] for e in printed] == [0, 0, 0]  # the recipe prints on the chief only
    logs = [e for e in lines if e["type"] == "log"]
    assert len(logs) == 6 and {e["rank"] for e in logs} == {0, 1}
    assert result.summary["steps"] == 3 * 8  # 512 samples / 64 per step, 3 epochs


def test_plain_torchrun_script_runs_unchanged_with_recipe_args():
    result = run_cli("train", str(RECIPES / "torchrun_script.py"), "-s", "mirrored", "--replicas", "2",
                     "--json", "--", "--steps", "3")
    assert result.returncode == 0, result.stderr[-2000:]
    outputs = sorted(e["line"] for e in result.json_lines() if e["type"] == "output")
    assert [o.split(":")[0] for o in outputs] == ["rank 0 of 2", "rank 1 of 2"]
    assert result.summary["recipe_kind"] == "script" and result.summary["world_size"] == 2
    table = run_cli("train", str(RECIPES / "torchrun_script.py"), "-s", "mirrored", "--replicas", "2", "--", "--steps", "1")
    assert table.returncode == 0 and "script (2 processes)" in table.stderr, table.stderr[-2000:]


@pytest.mark.parametrize("strategy", ["central-storage", "sharded"])
def test_a_plain_script_refuses_a_strategy_it_cannot_honour(strategy):
    result = run_cli("train", str(RECIPES / "torchrun_script.py"), "-s", strategy, "--replicas", "2")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: {RECIPES / 'torchrun_script.py'}: a plain script builds its own model and loop (its own DDP or "
        f"FSDP), so --strategy {strategy} cannot apply to it; -s mirrored (or multi-worker on a cluster) starts its "
        "processes")


def test_plain_script_that_raises_names_its_line(write_recipe):
    script = write_recipe("import os\n\nif __name__ == '__main__':\n    raise SystemExit('bad input: ' + os.environ['RANK'])\n",
                          "script.py")
    result = run_cli("train", str(script), "-s", "mirrored", "--replicas", "2")
    assert result.returncode == 4
    assert f"{script}:4: rank " in result.stderr and "SystemExit: bad input" in result.stderr
