"""The overhead benchmark's model and data, shared by all three contenders.

An MLP on synthetic data held in memory: big enough that a step is real work
(about 3.2M parameters), small enough for a 2-core CPU machine.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

IN_FEATURES = 512
HIDDEN = 1024
CLASSES = 10
NUM_SAMPLES = 16384
LR = 0.01


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def build_dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (NUM_SAMPLES,), generator=gen)
    return TensorDataset(x, y)
