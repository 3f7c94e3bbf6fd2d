"""The Strategy API from a custom loop, and iterable inputs of uneven length."""

import pytest

from tests.conftest import RECIPES, run_cli

pytestmark = pytest.mark.integration

COLLECTIVES = """
import torch

def main(strategy):
    r, n = strategy.replica_id, strategy.num_replicas
    mine = torch.arange(r + 1, dtype=torch.float32) + 10 * r   # replica r holds r+1 values
    gathered = strategy.gather(mine)
    total = strategy.reduce("sum", float(r + 1))
    biggest = strategy.reduce("max", torch.tensor([float(r)]))
    print(f"gather={gathered.tolist()} sum={total} max={biggest.item()} chief={strategy.is_chief}")
"""

# Replica 0 yields 5 batches, replica 1 yields 3: the epoch must end after 3 steps for
# both, without a hang, under the fit loop.
UNEVEN_ITERABLE = """
import torch
from torch import nn

defaults = {"global_batch_size": 8, "epochs": 2}

def model():
    return nn.Linear(3, 1)

def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

def loss(outputs, batch):
    return nn.functional.mse_loss(outputs, batch[1])

def train_data(ctx):
    count = 5 if ctx.replica_id == 0 else 3
    gen = torch.Generator().manual_seed(ctx.replica_id)
    return [(torch.randn(ctx.per_replica_batch_size, 3, generator=gen),
             torch.randn(ctx.per_replica_batch_size, 1, generator=gen)) for _ in range(count)]
"""


def test_gather_and_reduce_across_replicas(write_recipe):
    recipe = write_recipe(COLLECTIVES)
    result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = sorted((e["rank"], e["line"]) for e in result.json_lines() if e["type"] == "output")
    expected = "gather=[0.0, 10.0, 11.0] sum=3.0 max=1.0"
    assert lines == [(0, f"{expected} chief=True"), (1, f"{expected} chief=False")]


def test_uneven_iterables_end_the_epoch_together(write_recipe):
    recipe = write_recipe(UNEVEN_ITERABLE)
    result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--json", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.summary["steps"] == 6  # 2 epochs x min(5, 3)


def test_table_output_shows_rows_summary_and_rank_prefixed_prints():
    result = run_cli("train", str(RECIPES / "custom_loop.py"), "-s", "mirrored", "--replicas", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    text = result.stdout + result.stderr
    assert "[rank 0] epoch 2: mean loss" in text
    for header in ("rank", "device", "step", "loss", "samples/s", "mem MB", "peak MB", "status"):
        assert header in text
    assert "summary" in text and "succeeded" in text and "mirrored × 2" in text
