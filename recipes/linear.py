"""The seeds' first example: one Dense layer learns y = 3x + 2 (fit-style recipe).

TensorFlow's distribution tutorials start from ``Dense(1, input_shape=(1,))``
compiled with MSE and SGD; this is the same model as a distrun recipe. It never
names a strategy:

    distrun train recipes/linear.py                         # one device
    distrun train recipes/linear.py --strategy mirrored     # 2 CPU replicas (or one per GPU)
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 32, "epochs": 5}


def model():
    return nn.Linear(1, 1)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05)


def loss(outputs, batch):
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    gen = torch.Generator().manual_seed(1234)
    x = torch.rand(1024, 1, generator=gen) * 4 - 2
    y = 3 * x + 2 + 0.05 * torch.randn(1024, 1, generator=gen)
    return TensorDataset(x, y)


def eval_data(ctx):
    x = torch.linspace(-2, 2, 200).unsqueeze(1)
    return TensorDataset(x, 3 * x + 2)
