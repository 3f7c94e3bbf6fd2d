"""The scaling workload as a distrun custom loop (``_scaling_workload.py`` holds the work).

Run by `distrun bench resnet50` through `distrun train`, so it measures distrun
itself: the warm-up steps run, then ``--steps`` steps are timed between two
barriers, and rank 0 prints one JSON line.
"""

import json
import sys
import time

import torch

from distrun.bench import _scaling_workload as workload
from distrun.bench.models import parameter_count


def main(strategy):
    args = workload.parse_args(sys.argv[1:])
    cuda = strategy.device.type == "cuda"
    torch.manual_seed(0)
    with strategy.scope():
        model = workload.build_model(args, cuda)
        optimizer = workload.make_optimizer(model)
    model, optimizer = strategy.prepare(model, optimizer)
    images, labels = workload.synthetic_batch(args, strategy.device, strategy.replica_id)
    step = workload.make_step(model, optimizer, images, labels)

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
