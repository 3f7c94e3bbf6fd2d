"""MirroredStrategy: one process per device, DistributedDataParallel.

DDP's bucketed all-reduce overlaps with backward, which is why mirrored is the
default choice for synchronous training on one host. Sync batch norm is opt-in
(``--sync-batch-norm``) because it adds a collective per BatchNorm layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distrun.strategies.base import Strategy


class MirroredStrategy(Strategy):
    name = "mirrored"

    def __init__(self, *args: Any, sync_batch_norm: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync_batch_norm = sync_batch_norm

    def _wrap(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        model = model.to(self.device)
        if self._sync_batch_norm:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids), optimizer


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """Many hosts, the same model as mirrored (TF's MultiWorkerMirroredStrategy).

    DDP already all-reduces across every process of the group wherever it runs, so
    the difference from mirrored is where the processes are, which the worker
    servers decide; the training step is the same, and so are the parameters.
    """

    name = "multi-worker"
