"""Keeping a plain script's process groups alive until the process leaves.

A known PyTorch deadlock (pytorch/pytorch#56297): a script written like the
DDP tutorial calls ``destroy_process_group()`` while its DDP model is still
alive; when ``main()`` returns, the model's Reducer is destroyed with the GIL
held, drops the last reference to the gloo process group, and the group's
destructor joins a gloo thread that is waiting for the GIL to release a tensor.
Both wait forever (seen here about once in eight two-host runs).

distrun ends training processes with ``os._exit`` (no destructors), so holding
one more reference to every process group a script destroys is enough: the
group is shut down by ``destroy_process_group`` as asked, but never destructed
from inside the Reducer's destructor.
"""

from __future__ import annotations

from typing import Any

_KEPT: list[Any] = []


def keep_destroyed_process_groups() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "_distrun_keeps_groups", False):
        return

    def destroy_process_group(group: Any = None) -> None:
        _KEPT.extend(c10d._world.pg_map.keys())
        original(group)

    destroy_process_group._distrun_keeps_groups = True  # type: ignore[attr-defined]
    destroy_process_group.__doc__ = original.__doc__
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
