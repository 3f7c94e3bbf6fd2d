"""The scaling workload, shared by distrun's custom loop and the hand-written DDP baseline.

Both contenders must run exactly the same work: the same model, the same
synthetic ImageNet-shaped batch (made on the device once, as NVIDIA's
synthetic-data benchmarks do, so input is never the bottleneck), the same
optimizer and the same step (channels_last on GPU; ``--precision`` and ``--compile``
as distrun's flags of the same names mean them: distrun's strategy enters autocast
and compiles, the baseline does both by hand, wrap then compile).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from distrun.bench.models import build


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--compile", action="store_true")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace, cuda: bool) -> nn.Module:
    extra = {"image_size": args.image_size} if args.model == "mlp" else {}
    model = build(args.model, **extra)
    return model.to(memory_format=torch.channels_last) if cuda else model


def synthetic_batch(args: argparse.Namespace, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen, device=device)
    if device.type == "cuda":
        images = images.to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch,), generator=gen, device=device)
    return images, labels


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def make_step(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor,
              labels: torch.Tensor, autocast: torch.dtype | None = None) -> Callable[[], None]:
    """``autocast``: the dtype the step autocasts to itself (the baseline); None where the
    caller already does (distrun's ``strategy.run``). None must enter no autocast context at
    all: ``torch.autocast(enabled=False)`` would switch the caller's off, and distrun would
    time fp32 against a bf16 baseline (0.65x on an H100 until this was found)."""
    loss_fn = nn.CrossEntropyLoss()
    device_type = images.device.type

    def step() -> None:
        region = torch.autocast(device_type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with region:
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step
