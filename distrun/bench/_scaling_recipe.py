"""The scaling workload as a distrun custom loop (``_scaling_workload.py`` holds the work).

Run by `distrun bench resnet50` through `distrun train`, so it measures distrun
itself: the warm-up steps run, then each of ``--steps`` steps is timed, and rank 0
prints one JSON line: images/s from the median step, and whether the window was too
short to measure (``_scaling_workload.rate``).
"""

import json
import sys

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
    step_s = workload.time_steps(lambda: strategy.run(step), args.steps, cuda)
    strategy.barrier()
    if strategy.is_chief:
        found = workload.rate(step_s, args.batch * strategy.num_replicas)
        print(json.dumps({"bench": "scaling", **found, "replicas": strategy.num_replicas,
                          "parameters": parameter_count(strategy.unwrap())}), flush=True)
