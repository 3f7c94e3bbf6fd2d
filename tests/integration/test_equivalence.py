"""Same global batch, same seed: every synchronous strategy ends with one-device's parameters."""

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.conftest import run_cli
from tests.integration._recipes import EQUIV

pytestmark = pytest.mark.integration


def train(recipe, ckpt, strategy, *extra):
    replicas = [] if strategy == "one-device" else ["--replicas", "2"]
    result = run_cli("train", str(recipe), "--strategy", strategy, *replicas, "--json",
                     "--checkpoint-dir", str(ckpt), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def params(ckpt):
    data = torch.load(latest_checkpoint(ckpt), weights_only=True)
    return data


@pytest.mark.parametrize("samples", [97, 99])
def test_mirrored_and_central_storage_match_one_device(write_recipe, tmp_path, samples):
    recipe = write_recipe(EQUIV)
    runs = {}
    for strategy in ("one-device", "mirrored", "central-storage"):
        result = train(recipe, tmp_path / strategy, strategy, "--epochs", "2", "--", "--samples", str(samples))
        runs[strategy] = (params(tmp_path / strategy), result.summary)
    base, base_summary = runs["one-device"]
    assert base["step"] == 14  # 2 epochs x 7 global batches, the last of each holds one sample
    assert not any(k.startswith("module.") for k in base["model"])
    for strategy in ("mirrored", "central-storage"):
        data, summary = runs[strategy]
        assert data["step"] == 14 and data["strategy"] == strategy
        for key, tensor in base["model"].items():
            torch.testing.assert_close(data["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=f"{strategy}: {key}")
        assert summary["final_loss"] == pytest.approx(base_summary["final_loss"], rel=1e-4)
        # Sync-on-read metrics: reduced over both replicas, exact.
        assert summary["eval_metrics"]["accuracy"] == pytest.approx(base_summary["eval_metrics"]["accuracy"])
        assert summary["eval_metrics"]["loss"] == pytest.approx(base_summary["eval_metrics"]["loss"], rel=1e-4)


def test_parameters_actually_move(write_recipe, tmp_path):
    """Guards the test above against comparing untrained models."""
    recipe = write_recipe(EQUIV)
    a = params_after(recipe, tmp_path / "a", "1")
    b = params_after(recipe, tmp_path / "b", "5")
    assert any(not torch.allclose(a[k], b[k]) for k in a)


def params_after(recipe, ckpt, steps):
    train(recipe, ckpt, "one-device", "--steps", steps)
    return params(ckpt)["model"]
