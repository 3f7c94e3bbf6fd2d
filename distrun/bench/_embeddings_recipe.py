"""`distrun bench embeddings`: a click model whose one embedding table outweighs the rest, as a fit recipe.

``nn.Embedding(--rows, --dim)`` of users (1M x 32 by default: 128 MB of fp32) and a small MLP
on a user's row, trained with plain SGD on seeded synthetic clicks. A batch looks up a few
hundred of the table's rows: under mirrored DDP all-reduces the whole table's gradient every
step all the same; under ``--embeddings ps`` only those rows cross, to and from a ps task.
The same batches under both (the job's seed), and SGD changes only the rows looked up, so
both train to one-device's parameters: the bench compares their losses too.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

_parser = argparse.ArgumentParser(prog="_embeddings_recipe.py")
_parser.add_argument("--rows", type=int, default=1_000_000)
_parser.add_argument("--dim", type=int, default=32)
_parser.add_argument("--samples", type=int, default=16384)
ARGS = _parser.parse_args(sys.argv[1:])
#: The MLP's hidden width (bench/embeddings.py counts its parameters from it).
HIDDEN = 64

defaults = {"global_batch_size": 512, "steps": 20, "seed": 0}


class Clicks(nn.Module):
    """A click's logit from the user's row."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(ARGS.rows, ARGS.dim)
        self.mlp = nn.Sequential(nn.Linear(ARGS.dim, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, users: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.users(users)).squeeze(1)


def model() -> nn.Module:
    return Clicks()


def optimizer(params):  # noqa: ANN001, ANN201 - the recipe contract
    return torch.optim.SGD(params, lr=0.5)  # row-wise: the ps tasks may apply it


def loss(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(outputs, batch[1])


def train_data(ctx):  # noqa: ANN001, ANN201 - the recipe contract
    """Users drawn uniformly; a user clicks when its id is a multiple of three (a per-row fact to learn)."""
    gen = torch.Generator().manual_seed(1)
    users = torch.randint(0, ARGS.rows, (ARGS.samples,), generator=gen)
    return TensorDataset(users, (users % 3 == 0).float())
