"""`--clip-grad-norm`: the same clipped steps under every synchronous strategy, and a clip that binds."""

import pytest
import torch

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import run_cli
from tests.integration._recipes import EQUIV

pytestmark = pytest.mark.integration


def _model(recipe, ckpt, strategy, *extra):
    replicas = [] if strategy == "one-device" else ["--replicas", "2"]
    result = run_cli("train", str(recipe), "-s", strategy, *replicas, "--json", "--steps", "12",
                     "--checkpoint-dir", str(ckpt), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_checkpoint(latest_checkpoint(ckpt))["model"]


def test_every_synchronous_strategy_clips_the_global_norm_alike(write_recipe, tmp_path):
    recipe = write_recipe(EQUIV.replace("lr=0.01", "lr=0.5").replace("torch.optim.Adam", "torch.optim.SGD"))
    unclipped = _model(recipe, tmp_path / "free", "one-device")
    clipped = _model(recipe, tmp_path / "one", "one-device", "--clip-grad-norm", "0.05")
    assert any(not torch.allclose(clipped[k], unclipped[k], atol=1e-4) for k in clipped), "the clip must bind"
    for strategy in ("mirrored", "central-storage", "sharded"):
        other = _model(recipe, tmp_path / strategy, strategy, "--clip-grad-norm", "0.05")
        for key, tensor in clipped.items():
            torch.testing.assert_close(other[key], tensor, rtol=1e-5, atol=1e-6, msg=f"{strategy}: {key}")


@pytest.mark.parametrize("flags, says", [(["--clip-grad-norm", "0"], "--clip-grad-norm: expected a positive norm"),
                                         (["-s", "ps", "--clip-grad-norm", "1"], "--clip-grad-norm with --strategy "
                                                                                 "parameter-server")])
def test_a_clip_that_cannot_apply_is_refused(write_recipe, flags, says):
    result = run_cli("train", str(write_recipe(EQUIV)), *flags)
    assert result.returncode == 2 and says in result.stderr, result.stderr
