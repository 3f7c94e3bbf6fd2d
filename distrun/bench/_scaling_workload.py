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
import statistics
import time
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


#: A timed window shorter than this, or whose first half ran this much slower than its second
#: (the run was still warming up), is too short to measure: said so, not shown as a figure.
MIN_TIMED_S = 1.0
MAX_DRIFT = 0.15


def time_steps(step: Callable[[], None], steps: int, cuda: bool) -> list[float]:
    """Each step's seconds from the end of the one before. On a GPU, from CUDA events recorded
    after each step (no synchronisation inside the window, so the CPU may run ahead as it does
    in training); on the CPU, the wall clock."""
    if cuda:
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
        for index in range(steps):
            step()
            marks[index + 1].record()
        torch.cuda.synchronize()
        return [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(steps)]
    times, last = [], time.perf_counter()
    for _ in range(steps):
        step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def rate(step_s: Sequence[float], images_per_step: int) -> dict[str, object]:
    """Images/s from the median step (a straggling step early in the window, warm-up the
    ``--warmup`` steps did not cover, does not count), and why the figure cannot be trusted if
    it cannot: too few seconds timed, or the window's first half slower than its second."""
    median = statistics.median(step_s)
    half = len(step_s) // 2
    drift = statistics.median(step_s[:half]) / statistics.median(step_s[half:]) - 1 if half else 0.0
    timed_s = sum(step_s)
    short = None
    if timed_s < MIN_TIMED_S:
        short = f"{len(step_s)} timed steps took {timed_s:.2f} s (under {MIN_TIMED_S:g} s)"
    elif drift > MAX_DRIFT:
        short = f"its first {half} timed steps ran {drift:.0%} slower than the rest (still warming up)"
    return {"images_per_s": images_per_step / median if median > 0 else 0.0, "timed_s": timed_s,
            "drift": drift, "too_short": short}
