"""`distrun bench compression`: a communication-bound workload, as a custom loop.

A wide MLP (two hidden layers of ``--width``; 1.3M parameters, 5.3 MB of fp32
gradients at the default 1024) on a small batch, so that each step is mostly its
all-reduce: the workload where what goes on the wire decides the speed. The task is a
fixed random teacher's classes, drawn on the CPU from the step number and the replica,
so every compression sees the same batches and starts from the same parameters.

``--warmup`` steps run first, untimed (they cover PowerSGD's plain all-reduce warm-up,
10 steps by default), then ``--steps`` timed steps between two barriers. Rank 0 prints
one JSON line: samples/s over the timed steps and the training loss (the mean of the last
``_LOSS_WINDOW`` steps over every replica) after the same number of steps, and the same
mean over the first steps (``first_loss``), so a run that learned nothing shows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn

_INPUTS, _CLASSES, _LOSS_WINDOW = 256, 10, 5


def main(strategy) -> None:  # noqa: ANN001 - the recipe API
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="samples per replica per step")
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(sys.argv[1:])

    torch.manual_seed(0)
    teacher = torch.randn(_INPUTS, _CLASSES, generator=torch.Generator().manual_seed(1))
    with strategy.scope():
        model = nn.Sequential(nn.Linear(_INPUTS, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                              nn.Linear(args.width, _CLASSES))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = strategy.prepare(model, optimizer)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step * 1009 + strategy.replica_id)
        x = torch.randn(args.batch, _INPUTS, generator=gen)
        return x.to(strategy.device), (x @ teacher).argmax(dim=1).to(strategy.device)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses = []
    for step in range(args.warmup):
        losses.append(strategy.run(train_step, *batch(step)))
    strategy.barrier()
    start = time.perf_counter()
    for step in range(args.warmup, args.warmup + args.steps):
        losses.append(strategy.run(train_step, *batch(step)))
    strategy.barrier()
    elapsed = time.perf_counter() - start
    loss = strategy.reduce("mean", float(torch.stack(losses[-_LOSS_WINDOW:]).mean()))
    first_loss = strategy.reduce("mean", float(torch.stack(losses[:_LOSS_WINDOW]).mean()))
    if strategy.is_chief:
        parameters = sum(p.numel() for p in model.parameters())
        print(json.dumps({"bench": "compression", "samples_per_s": args.steps * args.batch * strategy.num_replicas
                          / elapsed, "loss": loss, "first_loss": first_loss, "steps": args.warmup + args.steps, "parameters": parameters}),
              flush=True)
