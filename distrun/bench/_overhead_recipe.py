"""The overhead workload as a fit-style recipe (distrun owns the loop)."""

import torch
from torch import nn

from distrun.bench import _workload


def model():
    return _workload.build_model()


def optimizer(params):
    return torch.optim.SGD(params, lr=_workload.LR)


def loss(outputs, batch):
    return nn.functional.cross_entropy(outputs, batch[1])


def train_data(ctx):
    return _workload.build_dataset()
