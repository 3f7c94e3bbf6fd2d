"""The overhead workload as a hand-written torchrun + DDP script, the baseline.

Written the way the PyTorch DDP tutorial writes it: DistributedSampler,
DataLoader, DDP. Rank 0 prints one JSON line with its own measurements, taken
exactly as distrun's runtime takes them (samples after the first step over the
time from the end of the first step to the end of the last).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from distrun.bench import _workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--global-batch-size", type=int, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    if args.device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(_workload.build_model().to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=_workload.LR)
    dataset = _workload.build_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.global_batch_size // world, sampler=sampler)

    step, epoch, samples = 0, 0, 0
    first_end = last_end = first_wall = None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            now = time.monotonic()
            if first_end is None:
                first_end, first_wall = now, time.time()
            else:
                samples += inputs.shape[0]
            last_end = now
            if step >= args.steps:
                break
        epoch += 1
    if rank == 0:
        rate = samples * world / (last_end - first_end) if last_end > first_end else 0.0  # one step: no rate
        print(json.dumps({"bench": "ddp", "samples_per_s": rate, "first_step_time": first_wall, "steps": step}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
