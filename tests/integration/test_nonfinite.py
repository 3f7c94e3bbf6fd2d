"""``--on-nonfinite``: a NaN loss at step 5 on one replica, under each mode."""

from __future__ import annotations

import pytest
import torch

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import assert_no_processes, run_cli

pytestmark = pytest.mark.integration

# Rank 1's loss is NaN at its 5th step (only there).
NAN_AT_5 = """
import os
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 8, "steps": 12}
calls = 0


def model():
    return nn.Linear(4, 1)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05)


def loss(outputs, batch):
    global calls
    calls += 1
    value = nn.functional.mse_loss(outputs, batch[1])
    if calls == 5 and os.environ["RANK"] == "1":
        return value * float("nan")
    return value


def train_data(ctx):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=gen)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))
"""


def _train(write_recipe, tmp_path, mode, strategy="mirrored"):
    return run_cli("train", str(write_recipe(NAN_AT_5)), "--strategy", strategy, "--replicas", "2", "--device", "cpu",
                   "--json", "--on-nonfinite", mode, "--checkpoint-dir", str(tmp_path / "ck"))


def test_stop_names_the_step_and_the_rank(write_recipe, tmp_path):
    result = _train(write_recipe, tmp_path, "stop")
    assert result.returncode == 4, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 failed at step 5: the loss is nan (--on-nonfinite stop"), last
    assert "Traceback" not in result.stderr
    assert_no_processes(str(tmp_path))


@pytest.mark.parametrize("strategy", ["mirrored", "sharded"])
def test_skip_drops_the_update_on_every_replica(write_recipe, tmp_path, strategy):
    """Under sharded the NaN reaches every rank's shards through the reduce-scatter; no rank steps."""
    result = _train(write_recipe, tmp_path, "skip", strategy)
    assert result.returncode == 0, result.stderr[-2000:]
    logs = [line for line in result.json_lines() if line["type"] == "log" and "nonfinite_skipped" in line["scalars"]]
    assert [(line["step"], line["scalars"]["nonfinite_replicas"]) for line in logs] == [(5, 1.0)], logs
    assert result.summary["steps"] == 12
    model = load_checkpoint(latest_checkpoint(tmp_path / "ck"))["model"]
    assert all(torch.isfinite(tensor).all() for tensor in model.values())  # the NaN never reached the weights


def test_warn_applies_the_update_and_says_so(write_recipe, tmp_path):
    result = _train(write_recipe, tmp_path, "warn")
    assert result.returncode == 0, result.stderr[-2000:]
    logs = [line for line in result.json_lines() if line["type"] == "log" and "nonfinite_applied" in line["scalars"]]
    # Each replica says what it saw. Rank 1's loss was NaN at step 5; the NaN update was
    # applied everywhere, so from step 6 on every loss is NaN, rank 0's too.
    assert [line["step"] for line in logs if line["rank"] == 1] == list(range(5, 13))
    assert [line["step"] for line in logs if line["rank"] == 0] == list(range(6, 13))
    model = torch.load(latest_checkpoint(tmp_path / "ck"), weights_only=True)["model"]
    assert not all(torch.isfinite(tensor).all() for tensor in model.values())  # warned, and applied


def test_a_bad_mode_is_one_line(write_recipe):
    result = run_cli("train", str(write_recipe(NAN_AT_5)), "--on-nonfinite", "skpi")
    assert result.returncode == 2
    assert "--on-nonfinite: expected stop, skip or warn. Received: 'skpi'" in result.stderr
