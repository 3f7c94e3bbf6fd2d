"""The scaling workload as a hand-written torchrun + DDP script (the `--compare ddp` baseline).

The same model, synthetic batch and timing as ``_scaling_recipe.py``, written
the way the PyTorch DDP tutorial writes it.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distrun.bench.models import build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and os.environ.get("DISTRUN_BENCH_DEVICE", "cpu") == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    extra = {"image_size": args.image_size} if args.model == "mlp" else {}
    model = build(args.model, **extra).to(device)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator(device=device).manual_seed(rank)
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen, device=device)
    labels = torch.randint(0, 1000, (args.batch,), generator=gen, device=device)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"bench": "scaling", "images_per_s": args.steps * args.batch * world / elapsed}), flush=True)
    model = None  # drop DDP before the group: see distrun/runtime/_teardown.py
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
