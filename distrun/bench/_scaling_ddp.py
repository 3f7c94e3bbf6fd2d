"""The scaling workload as a hand-written torchrun + DDP script (the `--compare ddp` baseline).

The same work as ``_scaling_recipe.py`` (``_scaling_workload.py``), driven the
way the PyTorch DDP tutorial drives it.
"""

import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distrun.bench import _scaling_workload as workload


def main() -> None:
    args = workload.parse_args()
    cuda = torch.cuda.is_available() and os.environ.get("DISTRUN_BENCH_DEVICE", "cpu") == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(workload.build_model(args, cuda).to(device),
                                    device_ids=[device.index] if cuda else None)
    optimizer = workload.make_optimizer(model)
    if args.compile:  # the PyTorch docs' order: wrap, then compile
        model = torch.compile(model)
    images, labels = workload.synthetic_batch(args, device, rank)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    step = workload.make_step(model, optimizer, images, labels, autocast=dtype)

    for _ in range(args.warmup):
        step()
    dist.barrier()
    step_s = workload.time_steps(step, args.steps, cuda)  # timed as distrun's run is
    dist.barrier()
    if rank == 0:
        print(json.dumps({"bench": "scaling", **workload.rate(step_s, args.batch * world)}), flush=True)
    del step, model  # drop DDP before the group: see distrun/runtime/_teardown.py
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
