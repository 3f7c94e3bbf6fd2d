"""`distrun bench pipeline`, `bench layouts` and `bench slowlinks`: an MLP whose layers are a chain, as a fit recipe.

``nn.Sequential(Linear(inputs, W), ReLU, [Block(W)] x layers, Linear(W, 10))``, each block an
``nn.Sequential(Linear(W, 4W), GELU, Linear(4W, W))``: a chain ``--pp`` cuts, MLP pairs
``--tp`` derives a plan for, repeated blocks for sharded's units and activation
checkpointing, the same model under every layout. The task is a fixed random teacher's
classes over seeded inputs, so every contender sees the same batches.

``bench slowlinks`` trains it under diloco and multi-worker over slow links and reads the
eval loss over time.

``bench pipeline`` makes the parameters large against a step's compute (a small batch):
what crosses hosts each step decides the speed. ``bench layouts`` makes the activations
large against the parameters (a large batch): what a rank keeps for backward decides its
memory.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

_parser = argparse.ArgumentParser(prog="_pipeline_recipe.py")
_parser.add_argument("--width", type=int, default=512)
_parser.add_argument("--layers", type=int, default=4)
_parser.add_argument("--inputs", type=int, default=256)
_parser.add_argument("--samples", type=int, default=4096)
ARGS = _parser.parse_args(sys.argv[1:])
_CLASSES = 10

defaults = {"global_batch_size": 32, "steps": 10, "seed": 0}


def model() -> nn.Module:
    width = ARGS.width
    blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
              for _ in range(ARGS.layers)]
    return nn.Sequential(nn.Linear(ARGS.inputs, width), nn.ReLU(), *blocks, nn.Linear(width, _CLASSES))


def optimizer(params):  # noqa: ANN001, ANN201 - the recipe API
    return torch.optim.Adam(params, lr=1e-4)


def loss(outputs: torch.Tensor, batch) -> torch.Tensor:  # noqa: ANN001 - the recipe API
    return nn.functional.cross_entropy(outputs, batch[1])


def train_data(ctx) -> TensorDataset:  # noqa: ANN001 - the recipe API
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(ARGS.inputs, _CLASSES, generator=gen)
    x = torch.randn(ARGS.samples, ARGS.inputs, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def eval_data(ctx) -> TensorDataset:  # noqa: ANN001 - the recipe API
    """The same teacher's classes on held-out inputs (`bench slowlinks` reads the loss over time)."""
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(ARGS.inputs, _CLASSES, generator=gen)
    x = torch.randn(256, ARGS.inputs, generator=torch.Generator().manual_seed(2))
    return TensorDataset(x, (x @ teacher).argmax(dim=1))
