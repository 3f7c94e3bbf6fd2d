"""DDP communication hooks that run in bucket order, one bucket at a time, off the backward thread.

DDP calls a hook once per bucket as backward fills it. A hook whose collectives are issued
from future callbacks (torch's ``powerSGD_hook`` issues the P and Q all-reduces that
way) lets two buckets' collectives interleave in a different order on different ranks,
and collectives on one group must be issued in the same order everywhere: under gloo a
two-bucket model deadlocked at PowerSGD's first compressed step. Here one background
thread per replica (Horovod's background loop) runs each bucket's whole exchange to its
end before it starts the next, in the order DDP hands them over, which is the same on
every rank. Backward keeps computing meanwhile, as with DDP's own all-reduce.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OrderedBucketHook"]


class OrderedBucketHook:
    """A DDP hook (``hook``) that runs ``exchange(bucket) -> tensor`` for each bucket, in order."""

    def __init__(self, exchange: Callable[[Any], torch.Tensor], name: str) -> None:
        self._exchange = exchange
        self._work: queue.Queue[tuple[Any, torch.futures.Future[torch.Tensor]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations: none, or real classes
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._work.put((bucket, future))
        return future

    def _serve(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            bucket, future = item
            try:
                future.set_result(self._exchange(bucket))
            except Exception as exc:  # noqa: BLE001 - DDP raises it where it waits for the bucket
                future.set_exception(exc)

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=10.0)
