"""A classifier on real data: scikit-learn's handwritten digits (fit-style recipe).

The 1,797 8x8 images ship inside scikit-learn, so nothing is downloaded. 80% train,
20% held out for eval; accuracy is a torchmetrics metric, reduced over all replicas
when read. docs/recipes.md lists the accuracy reached under each strategy.

    pip install -e '.[examples]'
    distrun train recipes/digits.py --strategy mirrored
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 64, "epochs": 10}


def _split():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def model():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def optimizer(params):
    return torch.optim.Adam(params, lr=3e-3)


def loss(outputs, batch):
    return nn.functional.cross_entropy(outputs, batch[1])


def train_data(ctx):
    return TensorDataset(*_split()[0])


def eval_data(ctx):
    return TensorDataset(*_split()[1])


def metrics():
    from torchmetrics.classification import MulticlassAccuracy

    return {"accuracy": MulticlassAccuracy(num_classes=10, average="micro")}
