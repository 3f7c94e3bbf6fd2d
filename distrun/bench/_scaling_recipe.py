"""The scaling workload as a distrun custom loop: synthetic ImageNet-shaped data, timed steps.

Run by `distrun bench resnet50` through `distrun train` (so it measures distrun
itself): every replica makes one batch of random images and labels on its own
device once, as NVIDIA's synthetic-data benchmarks do, so input is never the
bottleneck; runs the warm-up steps; then times ``--steps`` steps between two
barriers. Rank 0 prints one JSON line. On GPU: channels_last and bf16 autocast.
"""

import argparse
import json
import sys
import time

import torch
from torch import nn

from distrun.bench.models import build, parameter_count


def main(strategy):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(sys.argv[1:])

    cuda = strategy.device.type == "cuda"
    torch.manual_seed(0)
    with strategy.scope():
        extra = {"image_size": args.image_size} if args.model == "mlp" else {}
        model = build(args.model, **extra)
        if cuda:
            model = model.to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)

    gen = torch.Generator(device=strategy.device).manual_seed(strategy.replica_id)
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen, device=strategy.device)
    if cuda:
        images = images.to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch,), generator=gen, device=strategy.device)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        strategy.run(step)
    if cuda:
        torch.cuda.synchronize()
    strategy.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        strategy.run(step)
    if cuda:
        torch.cuda.synchronize()
    strategy.barrier()
    elapsed = time.perf_counter() - start
    if strategy.is_chief:
        images_per_s = args.steps * args.batch * strategy.num_replicas / elapsed
        print(json.dumps({"bench": "scaling", "images_per_s": images_per_s, "replicas": strategy.num_replicas,
                          "parameters": parameter_count(strategy.unwrap())}), flush=True)
