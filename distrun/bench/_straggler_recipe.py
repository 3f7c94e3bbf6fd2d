"""The straggler benchmark's workload: a small regression whose step time is an injected sleep.

``-- --step-s S --slow-rank R --slow-factor K``: every worker sleeps S per step,
worker R sleeps K x S. Compute is tiny next to S, so the step times are what the
benchmark says they are, and the bound for asynchronous over synchronous
training is exact arithmetic (docs/performance.md).
"""

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 48}


def _arg(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


STEP_S, SLOW_RANK, SLOW_FACTOR = _arg("--step-s", 0.03), _arg("--slow-rank", 1), _arg("--slow-factor", 3.0)
_SLEEP_S = STEP_S * (SLOW_FACTOR if int(os.environ.get("RANK", "0")) == SLOW_RANK else 1.0)


def model():
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.02)


def loss(outputs, batch):
    time.sleep(_SLEEP_S)
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6144, 16, generator=gen)
    w = torch.linspace(-1, 1, 16).unsqueeze(1)
    return TensorDataset(x, torch.tanh(x @ w) + 0.1)
