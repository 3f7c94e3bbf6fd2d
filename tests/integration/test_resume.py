"""A checkpoint written under one strategy resumes under another, exactly."""

import pytest
import torch

from distrun.strategies import latest_checkpoint, list_checkpoints
from tests.conftest import run_cli
from tests.integration._recipes import EQUIV

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]


def train(recipe, ckpt, strategy, steps, *extra):
    replicas = [] if strategy == "one-device" else ["--replicas", "2"]
    result = run_cli("train", str(recipe), "-s", strategy, *replicas, "--json", "--steps", str(steps),
                     "--checkpoint-dir", str(ckpt), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(latest_checkpoint(ckpt), weights_only=True)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """10 steps of one-device, never interrupted: every strategy's 10 steps end here
    (tests/integration/test_equivalence.py)."""
    root = tmp_path_factory.mktemp("whole")
    (root / "recipe.py").write_text(EQUIV)
    return train(root / "recipe.py", root / "ck", "one-device", 10)


@pytest.mark.parametrize("first, second", [("one-device", "mirrored"), ("mirrored", "one-device"),
                                           ("central-storage", "mirrored")])
def test_resume_across_strategies_equals_an_uninterrupted_run(write_recipe, tmp_path, whole, first, second):
    recipe = write_recipe(EQUIV)
    # 10 steps cross the epoch boundary (7 batches per epoch) after the resume point 5.
    part = train(recipe, tmp_path / "part", first, 5, "--checkpoint-every", "2", "--keep-checkpoints", "2")
    assert part["step"] == 5 and part["epoch"] == 0 and part["batch_in_epoch"] == 5
    assert [s for s, _ in list_checkpoints(tmp_path / "part")] == [4, 5]
    resumed = train(recipe, tmp_path / "part", second, 10, "--resume")
    assert resumed["step"] == 10
    assert resumed["optimizer"]["state"], "optimizer state must be carried over"
    for key, tensor in whole["model"].items():
        torch.testing.assert_close(resumed["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def test_resume_without_a_checkpoint_is_said_before_any_rank_starts(write_recipe, tmp_path):
    recipe = write_recipe(EQUIV)
    (tmp_path / "empty").mkdir()
    for folder, why in ((tmp_path / "none", "no such folder"), (tmp_path / "empty", "no checkpoint to resume from")):
        result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "2", "--resume",
                         "--checkpoint-dir", str(folder))
        assert result.returncode == 5
        line = result.stderr.strip()
        assert line.startswith(f"error: --resume: {folder}: {why}") and "rank" not in line, line


def test_resume_says_what_it_resumed_and_that_nothing_is_left(write_recipe, tmp_path):
    recipe = write_recipe(EQUIV)
    train(recipe, tmp_path / "ck", "mirrored", 4)
    result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--json", "--steps", "6",
                     "--checkpoint-dir", str(tmp_path / "ck"), "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    resumed = [line for line in result.json_lines() if line["type"] == "resumed"]
    path = str(tmp_path / "ck" / "ckpt-000000004.pt")
    assert [(line["step"], line["path"], line["past_end"]) for line in resumed] == [(4, path, False)]
    assert result.summary["resumed"] == {"path": path, "step": 4, "past_end": False}
    assert result.summary["steps"] == 6

    done = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "3",
                   "--checkpoint-dir", str(tmp_path / "ck"), "--resume")  # the table, as a user sees it
    assert done.returncode == 0, done.stderr[-2000:]
    newest = str(tmp_path / "ck" / "ckpt-000000006.pt")
    assert (f"resumed from {newest} at step 6: already at or past the job's last step (--steps, --epochs), "
            "so nothing is trained") in done.stderr
    assert "nothing trained" in done.stderr  # and the summary table says it again


WIDER = EQUIV.replace("nn.Linear(6, 16)", "nn.Linear(6, 8)").replace("nn.Linear(16, 3)", "nn.Linear(8, 3)")


def test_a_checkpoint_of_another_model_names_the_file_and_the_shapes(write_recipe, tmp_path):
    assert WIDER != EQUIV, "the recipe's layers changed: update WIDER"
    train(write_recipe(EQUIV), tmp_path / "ck", "mirrored", 2)
    result = run_cli("train", str(write_recipe(WIDER, "wider.py")), "-s", "mirrored", "--replicas", "2",
                     "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck"), "--resume")
    assert result.returncode == 5, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "while restoring the checkpoint: " in last and "Traceback" not in result.stderr
    assert (f"{tmp_path / 'ck' / 'ckpt-000000002.pt'}: not a checkpoint of this model: size mismatch for "
            "0.weight (checkpoint [16, 6], model [8, 6])") in last, last
