"""``--tensorboard DIR``: event files that TensorBoard's own reader reads back."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import REPO, run_cli
from tests.integration._recipes import EQUIV, PS_RECIPE

pytestmark = pytest.mark.integration


def read(folder: Path) -> dict[str, list[tuple[int, float]]]:
    board = EventAccumulator(str(folder))
    board.Reload()
    return {tag: [(event.step, event.value) for event in board.Scalars(tag)] for tag in board.Tags()["scalars"]}


@pytest.mark.parametrize("strategy", ["mirrored", "sharded"])
def test_a_fit_recipe_writes_loss_rate_learning_rate_and_eval(write_recipe, tmp_path, strategy):
    """sharded: the learning rate is read from the optimizer rebuilt on the shards."""
    board = tmp_path / "tb"
    result = run_cli("train", str(write_recipe(EQUIV)), "--strategy", strategy, "--replicas", "2", "--device",
                     "cpu", "--epochs", "2", "--log-interval-s", "0", "--json", "--tensorboard", str(board))
    assert result.returncode == 0, result.stderr[-2000:]
    scalars = read(board)
    steps = [line for line in result.json_lines() if line["type"] == "step" and line["rank"] == 0]
    assert [step for step, _ in scalars["train/loss"]] == [line["step"] for line in steps]  # every step event of rank 0
    assert scalars["train/loss"][-1][1] == pytest.approx(steps[-1]["loss"])
    assert scalars["train/learning_rate"][0] == (1, pytest.approx(0.01))  # the recipe's Adam lr
    assert "train/samples_per_s" in scalars
    evals = [line for line in result.json_lines() if line["type"] == "eval"]
    assert [step for step, _ in scalars["eval/accuracy"]] == [line["step"] for line in evals] == [7, 14]
    assert scalars["eval/loss"][-1][1] == pytest.approx(evals[-1]["metrics"]["loss"])


def test_strategy_log_scalars_and_ps_figures_are_written(tmp_path):
    board = tmp_path / "tb"
    result = run_cli("train", str(REPO / "recipes" / "custom_loop.py"), "--strategy", "mirrored", "--replicas", "2",
                     "--device", "cpu", "--json", "--tensorboard", str(board))
    assert result.returncode == 0, result.stderr[-2000:]
    logged = [line for line in result.json_lines() if line["type"] == "log" and line["rank"] == 0]
    assert logged and sorted(read(board)) >= ["epoch", "mean_loss"]
    assert read(board)["mean_loss"][-1][1] == pytest.approx(logged[-1]["scalars"]["mean_loss"])

    ps_board = tmp_path / "tb-ps"
    recipe = tmp_path / "ps.py"
    recipe.write_text(PS_RECIPE)
    result = run_cli("train", str(recipe), "--strategy", "parameter-server", "--replicas", "2", "--steps", "30",
                     "--json", "--tensorboard", str(ps_board))
    assert result.returncode == 0, result.stderr[-2000:]
    ps = read(ps_board / "ps0")
    assert {"ps/updates", "ps/bytes_in", "ps/bytes_out", "ps/params", "ps/workers"} <= set(ps)
    assert ps["ps/updates"][-1][1] > 0


def test_without_the_package_the_error_says_how_to_get_it(write_recipe, tmp_path):
    # A job whose ranks cannot import tensorboard (a path entry that shadows it with an ImportError).
    shadow = tmp_path / "shadow"
    (shadow / "tensorboard").mkdir(parents=True)
    (shadow / "tensorboard" / "__init__.py").write_text("raise ImportError('no tensorboard here')\n")
    result = run_cli("train", str(write_recipe(EQUIV)), "--strategy", "mirrored", "--replicas", "2", "--device", "cpu",
                     "--steps", "3", "--tensorboard", str(tmp_path / "tb"), env={"PYTHONPATH": str(shadow)})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--tensorboard needs the tensorboard package on every training host: pip install 'distrun[tensorboard]'" \
        in result.stderr
