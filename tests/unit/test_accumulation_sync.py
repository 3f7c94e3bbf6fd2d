"""`--accumulate N` synchronises gradients once a step (strategies/step/accumulation.py's
``gradient_sync``): under DDP one all-reduce of the bucket, not N; under FSDP2 no reduce-scatter
until the last micro-batch. Two real gloo processes. The parameter tests (tests/integration)
cannot tell this apart: a mean synchronised after every micro-batch sums to the same gradient."""

from __future__ import annotations

import multiprocessing as mp
import traceback

import torch

from tests._sshd import free_port

_MICRO = 4


def _rank(rank: int, port: int, queue) -> None:  # noqa: ANN001 - a spawn target
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from distrun.strategies.step.accumulation import gradient_sync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(nn.Linear(8, 2))
        all_reduces = [0]

        def counted(state, bucket):  # noqa: ANN001, ANN202 - DDP's comm hook signature
            all_reduces[0] += 1
            return default_hooks.allreduce_hook(dist.group.WORLD, bucket)

        ddp.register_comm_hook(None, counted)
        for index in range(_MICRO):
            with gradient_sync(ddp, index == _MICRO - 1):
                ddp(torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * rank + index))).sum().backward()

        torch.manual_seed(0)
        sharded = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        fully_shard(sharded)
        grads_before_last = None
        for index in range(_MICRO):
            with gradient_sync(sharded, index == _MICRO - 1):
                sharded(torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * rank + index))).sum().backward()
            if index == _MICRO - 2:  # no reduce-scatter yet: the sharded parameters have no gradient
                grads_before_last = [param.grad is not None for param in sharded.parameters()]
        grads_after = [param.grad is not None for param in sharded.parameters()]
        queue.put((rank, "ok", all_reduces[0], grads_before_last, grads_after))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, type(exc).__name__, str(exc), traceback.format_exc(), None))
    finally:
        dist.destroy_process_group()


def test_gradients_are_synchronised_once_a_step_under_ddp_and_fsdp2() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    found = dict((item[0], item[1:]) for item in (queue.get(timeout=120) for _ in procs))
    for proc in procs:
        proc.join(30)
    for rank in (0, 1):
        status, all_reduces, before_last, after = found[rank]
        assert status == "ok", found[rank]
        assert all_reduces == 1, f"rank {rank}: {all_reduces} all-reduces for {_MICRO} micro-batches"
        assert before_last == [False] * 4 and after == [True] * 4, (before_last, after)
