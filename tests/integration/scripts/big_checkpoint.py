"""The model behind docs/performance.md's `--async-checkpoint` figures (once a `big.py` outside
the repository): 12 x ``Linear(2048, 2048)``, 50.4M parameters, Adam, so 604 MB a checkpoint.

Batch 64, MSE loss, 1,024 random samples. ``-- --eval`` adds ``eval_data`` (256 more), so the
run ends in an evaluation the last save is written behind. Run by
tests/integration/test_bench_async_checkpoint.py:

    distrun train tests/integration/scripts/big_checkpoint.py -s sharded --replicas 2 --steps 12 \\
        --checkpoint-every 2 --checkpoint-dir ck [--async-checkpoint] --json [-- --eval]
"""

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 64}

WIDTH = 2048


def model():
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(12)])


def optimizer(params):
    return torch.optim.Adam(params, lr=1e-4)


def loss(outputs, batch):
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(1024, WIDTH, generator=gen), torch.randn(1024, WIDTH, generator=gen))


if "--eval" in sys.argv:

    def eval_data(ctx):
        gen = torch.Generator().manual_seed(1)
        return TensorDataset(torch.randn(256, WIDTH, generator=gen), torch.randn(256, WIDTH, generator=gen))
