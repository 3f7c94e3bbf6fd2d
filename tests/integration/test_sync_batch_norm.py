"""``--sync-batch-norm`` under mirrored x2 on CPU (gloo): BatchNorm over the global batch.

With the flag, each replica's BatchNorm normalises with the statistics of both replicas'
samples (and its backward sums the gradient terms over both), so the job ends with
one-device's parameters and running statistics: the whole batch on one device. Without
it, each replica normalises its own half, and the parameters differ; that half of the
test guards the first against comparing runs where BatchNorm does not matter.
"""

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.conftest import run_cli

pytestmark = pytest.mark.integration

# 96 samples at global batch 16: six full batches an epoch, eight samples a replica, no padding
# (padding would count in the statistics; only the loss weighting knows it is padding).
BATCH_NORM = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 16}


def model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def loss(outputs, batch):
    return nn.functional.cross_entropy(outputs, batch[1])


def train_data(ctx):
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(96, 6, generator=gen) * 3 + 1
    return TensorDataset(x, (x[:, 0] > 1).long() + (x[:, 1] > 1).long())
"""


def trained(recipe, ckpt, strategy, *extra):
    replicas = [] if strategy == "one-device" else ["--replicas", "2"]
    result = run_cli("train", str(recipe), "--strategy", strategy, *replicas, "--json", "--epochs", "2",
                     "--checkpoint-dir", str(ckpt), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    data = torch.load(latest_checkpoint(ckpt), weights_only=True)
    assert data["step"] == 12
    return data["model"]


def test_sync_batch_norm_matches_one_device_and_plain_batch_norm_does_not(write_recipe, tmp_path):
    recipe = write_recipe(BATCH_NORM)
    base = trained(recipe, tmp_path / "one", "one-device")
    synced = trained(recipe, tmp_path / "sync", "mirrored", "--sync-batch-norm")
    plain = trained(recipe, tmp_path / "plain", "mirrored")
    assert set(synced) == set(base)  # BatchNorm's own keys: the checkpoint loads into the recipe's model
    for key, tensor in base.items():
        torch.testing.assert_close(synced[key], tensor, rtol=1e-5, atol=1e-6, msg=f"--sync-batch-norm: {key}")
    assert int(base["1.num_batches_tracked"]) == 12
    differs = [key for key, tensor in base.items() if tensor.is_floating_point()
               and not torch.allclose(plain[key], tensor, rtol=1e-4, atol=1e-5)]
    assert "0.weight" in differs and "1.running_var" in differs, differs
