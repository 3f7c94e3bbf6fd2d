"""`distrun bench memory`: one model of ``--layers`` x ``--width`` Linear blocks, as a custom loop.

At the defaults (24 blocks of 2048) it is 100.7M parameters: 403 MB of fp32 parameters,
403 MB of gradients and 806 MB of Adam's two moments for a replica that holds them all.
Each rank measures, after ``--steps`` steps:

- the bytes it holds of each: parameters, gradients, optimizer state (a sharded tensor
  counts its local shard only): what sharding divides by the number of ranks;
- its resident memory before the model was built (``base_mb``: the interpreter, torch, the
  process group) and its peak over the whole run (``peak_mb``, VmHWM): the whole process.

Rank 0 prints one JSON line with every rank's figures.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

_MB = 2 ** 20


def _status_mb(field: str) -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    return local.numel() * local.element_size()


def main(strategy) -> None:  # noqa: ANN001 - the recipe API
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(sys.argv[1:])

    base_mb = _status_mb("VmRSS")
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    model, optimizer = strategy.prepare(model, optimizer)
    parameters = sum(p.shape.numel() for p in model.parameters())  # a DTensor's shape is the whole tensor's
    gen = torch.Generator().manual_seed(1)

    def step(inputs: torch.Tensor) -> torch.Tensor:
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    for _ in range(args.steps):
        strategy.run(step, torch.randn(4, args.width, generator=gen))
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters())
    state = sum(_local_bytes(value) for per_param in optimizer.state.values() for value in per_param.values()
                if isinstance(value, torch.Tensor))
    mine = torch.tensor([[base_mb, params / _MB, grads / _MB, state / _MB, _status_mb("VmHWM")]], dtype=torch.float64)
    every = strategy.gather(mine)
    if strategy.is_chief:
        keys = ("base_mb", "params_mb", "grads_mb", "optimizer_mb", "peak_mb")
        print(json.dumps({"bench": "memory", "strategy": strategy.name, "parameters": parameters,
                          "ranks": [dict(zip(keys, (round(float(v), 1) for v in row))) for row in every]}),
              flush=True)
