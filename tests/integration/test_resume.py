"""A checkpoint written under one strategy resumes under another, exactly."""

import pytest
import torch

from distrun.strategies import latest_checkpoint, list_checkpoints
from tests.conftest import run_cli
from tests.integration._recipes import EQUIV

pytestmark = pytest.mark.integration


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


def test_resume_without_a_checkpoint_is_a_clear_error(write_recipe, tmp_path):
    recipe = write_recipe(EQUIV)
    result = run_cli("train", str(recipe), "--steps", "2", "--resume", "--checkpoint-dir", str(tmp_path / "empty"))
    assert result.returncode == 5
    assert "no checkpoint to resume from" in result.stderr
    assert "Traceback" not in result.stderr
