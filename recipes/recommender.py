"""A small recommendation model on synthetic clicks (fit-style recipe), for `--embeddings ps`.

Two embedding tables and an MLP, the shape of a DLRM: a large user table (20,000 rows,
1.3 MB; real ones hold billions of rows) looked up once per example, and a small table of
item categories pooled over the clicked item's categories (an ``nn.EmbeddingBag``). Each
batch touches a few dozen user rows, so under ``--embeddings ps`` replicas pull and push only
those, while the MLP and the small table are DDP's, all-reduced as under mirrored.

Adagrad, the usual optimizer of recommendation tables, changes only the rows a batch looks
up, so the hybrid's parameters equal one-device's (``-- --optimizer sgd`` too; ``adam`` is
refused there, since its moments move every row).

    distrun train recipes/recommender.py -s mirrored --replicas 2 --embeddings ps --ps-tasks 1 --ps-partition-mb 1
    distrun train recipes/recommender.py -s mirrored            # the whole table all-reduced each step
"""

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

USERS, CATEGORIES, USER_DIM, CATEGORY_DIM, PER_ITEM = 20_000, 64, 16, 8, 3
defaults = {"global_batch_size": 64, "steps": 40}
OPTIMIZER = sys.argv[sys.argv.index("--optimizer") + 1] if "--optimizer" in sys.argv else "adagrad"


class Recommender(nn.Module):
    """Click probability (as a logit) of a (user, item categories) pair."""

    def __init__(self):
        super().__init__()
        self.users = nn.Embedding(USERS, USER_DIM)
        self.categories = nn.EmbeddingBag(CATEGORIES, CATEGORY_DIM, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(USER_DIM + CATEGORY_DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):  # x: (batch, 1 + PER_ITEM) ids: the user, then the item's categories
        features = torch.cat([self.users(x[:, 0]), self.categories(x[:, 1:])], dim=1)
        return self.mlp(features).squeeze(1)


def model():
    return Recommender()


def optimizer(params):
    if OPTIMIZER == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    if OPTIMIZER == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.1)  # as Keras and TensorFlow start it


def loss(outputs, batch):
    return nn.functional.binary_cross_entropy_with_logits(outputs, batch[1])


def _clicks(n, seed):
    """Users and categories with hidden tastes; a click is drawn from how well they agree."""
    tastes = torch.Generator().manual_seed(0)  # the same world for training and evaluation
    user_taste, category_taste = torch.randn(USERS, 4, generator=tastes), torch.randn(CATEGORIES, 4, generator=tastes)
    gen = torch.Generator().manual_seed(seed)
    users = torch.randint(0, USERS, (n, 1), generator=gen)
    categories = torch.randint(0, CATEGORIES, (n, PER_ITEM), generator=gen)
    affinity = (user_taste[users[:, 0]] * category_taste[categories].mean(dim=1)).sum(dim=1)
    clicks = torch.bernoulli(torch.sigmoid(2 * affinity), generator=gen)
    return TensorDataset(torch.cat([users, categories], dim=1), clicks)


def train_data(ctx):
    return _clicks(8192, 1)


def eval_data(ctx):
    return _clicks(1024, 2)

