"""Issue 51's hybrid with its dense replica on the GPU: the table on a CPU ps task never lands on the
GPU whole (only the rows a batch looks up are pulled to the device), and the parameters are one
CUDA device's. One GPU: one dense replica beside one ps task; two CUDA replicas (NCCL) need two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.conftest import run_cli

pytestmark = pytest.mark.gpu

#: A user table of 64 MB (1M rows of 16 floats) beside a small MLP: its Adagrad sums another 64 MB.
RECIPE = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset

USERS, DIM = 1_000_000, 16
defaults = {"global_batch_size": 64, "steps": 20}


class Clicks(nn.Module):
    def __init__(self):
        super().__init__()
        self.users = nn.Embedding(USERS, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.mlp(self.users(x)).squeeze(1)


def model():
    return Clicks()


def optimizer(params):
    return torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.1)


def loss(outputs, batch):
    return nn.functional.binary_cross_entropy_with_logits(outputs, batch[1])


def train_data(ctx):
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, USERS, (4096,), generator=gen), torch.bernoulli(torch.full((4096,), 0.3)))
'''
TABLE_MB = 1_000_000 * 16 * 4 / 2**20


def _train(recipe: Path, ckpt: Path, *flags: str) -> dict:
    result = run_cli("train", str(recipe), "--device", "cuda", "--json", "--steps", "20", "--checkpoint-dir", str(ckpt),
                     *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["status"] == "succeeded", summary
    return summary


def test_the_table_stays_on_the_ps_task_and_the_cuda_replica_ends_as_one_device(tmp_path):
    recipe = tmp_path / "clicks.py"
    recipe.write_text(RECIPE)
    one = _train(recipe, tmp_path / "one")
    hybrid = _train(recipe, tmp_path / "hybrid", "-s", "mirrored", "--replicas", "1", "--embeddings", "ps",
                    "--ps-tasks", "1", "--ps-partition-mb", "1")
    one_peak, replica_peak = one["peak_mem_mb"]["0"], hybrid["peak_mem_mb"]["0"]  # CUDA's max allocated, MiB
    print(f"CUDA peak: one device {one_peak:.1f} MiB, the hybrid's replica {replica_peak:.1f} MiB; table {TABLE_MB:.0f} MiB")
    assert one_peak >= TABLE_MB, one["peak_mem_mb"]  # the reference holds the table (and its sums) on the GPU
    assert replica_peak < TABLE_MB / 8, hybrid["peak_mem_mb"]  # the replica holds only rows, never the table
    a = torch.load(latest_checkpoint(tmp_path / "one"), weights_only=True, map_location="cpu")["model"]
    b = torch.load(latest_checkpoint(tmp_path / "hybrid"), weights_only=True, map_location="cpu")["model"]
    for key, tensor in a.items():
        torch.testing.assert_close(b[key], tensor, rtol=1e-4, atol=1e-5, msg=key)
