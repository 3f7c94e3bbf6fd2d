"""Matrix factorisation on synthetic clicks (fit-style recipe): sparse Adam under `--embeddings ps`.

A click's logit is the dot product of a user's and an item's embedding. Both tables are
``nn.Embedding(sparse=True)``: a batch's backward gives only the rows it looked up, and
``torch.optim.SparseAdam`` keeps Adam's moments per row and moves only those rows, so the
hybrid's parameters equal one-device's (recipes/recommender.py's Adagrad is the other row-wise
optimizer; plain Adam moves every row and is refused there). A model with dense layers needs
an optimizer those can take as well: SparseAdam takes sparse gradients only.

    distrun train recipes/factorization.py -s mirrored --replicas 2 --embeddings ps --ps-tasks 1 --ps-partition-mb 0.1
    distrun train recipes/factorization.py            # one device, the same parameters
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

USERS, ITEMS, DIM = 20_000, 500, 16
defaults = {"global_batch_size": 64, "steps": 20}


class Factorization(nn.Module):
    """The user table (1.3 MB) goes to the ps tasks at --ps-partition-mb 0.1; the item table (32 KB)
    stays with DDP, whose gloo all-reduce takes its sparse gradients (NCCL takes none: on GPUs give
    --ps-partition-mb 0.001, both tables on the ps tasks). Sparse gradients take neither
    --clip-grad-norm nor fp16's unscaling, here as on one device."""

    def __init__(self):
        super().__init__()
        self.users = nn.Embedding(USERS, DIM, sparse=True)
        self.items = nn.Embedding(ITEMS, DIM, sparse=True)

    def forward(self, x):  # x: (batch, 2) ids: the user, the item
        return (self.users(x[:, 0]) * self.items(x[:, 1])).sum(dim=1)


def model():
    return Factorization()


def optimizer(params):
    return torch.optim.SparseAdam(list(params), lr=0.01)


def loss(outputs, batch):
    return nn.functional.binary_cross_entropy_with_logits(outputs, batch[1])


def _clicks(n, seed):
    """A user clicks an item as their hidden tastes agree."""
    tastes = torch.Generator().manual_seed(0)
    user_taste, item_taste = torch.randn(USERS, 4, generator=tastes), torch.randn(ITEMS, 4, generator=tastes)
    gen = torch.Generator().manual_seed(seed)
    users, items = torch.randint(0, USERS, (n,), generator=gen), torch.randint(0, ITEMS, (n,), generator=gen)
    clicks = torch.bernoulli(torch.sigmoid(2 * (user_taste[users] * item_taste[items]).sum(dim=1)), generator=gen)
    return TensorDataset(torch.stack([users, items], dim=1), clicks)


def train_data(ctx):
    return _clicks(8192, 1)


def eval_data(ctx):
    return _clicks(1024, 2)
