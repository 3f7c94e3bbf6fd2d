"""Copying a sharded checkpoint out of the model behind training (``--async-checkpoint``).

A step that saves used to wait while DCP copied every shard into fresh host memory: on a CPU
that copy is half of a synchronous save (0.59x of it, issue 33). But the parameters and the
optimizer's state do not change until the next ``optimizer.step()``, so the copy can overlap
the next forward and backward. So:

- the buffers (which a forward may change: BatchNorm's running statistics) are cloned at
  once, and the RNG and the data position are already in the sidecar;
- everything else is copied on DCP's stager's own thread (``DefaultStager`` with async
  staging), into host buffers it keeps from one save to the next (pinned on a GPU, so the
  device-to-host copy runs on a side stream; the compute stream's queued kernels, the step
  that produced these values, are finished first, as that stream does not wait for ours.
  Not yet run on a GPU);
- ``wait_before_step`` blocks the next ``optimizer.step()`` until the copy is done (a
  pre-hook on the optimizer, so any loop, fit or custom, gets it), and says how long it waited;
- the write runs on DCP's upload thread once the copy is done, as before.

The host buffers are reused, so a save starts only once the previous one is written (the
strategy's ``save`` waits for it first). torch releases without the staging API (before
2.9) copy at once, as before; ``background`` says which.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

__all__ = ["BackgroundStaging"]

try:  # torch 2.9+
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
except ImportError:  # pragma: no cover - older torch: the copy blocks the saving step
    DefaultStager = StagingOptions = AsyncSaveResponse = None  # type: ignore[assignment, misc]


class BackgroundStaging:
    """One per strategy: its stager (and the host buffers it keeps), and the save being copied."""

    def __init__(self, *, cuda: bool) -> None:
        self.background = DefaultStager is not None
        self._cuda = cuda
        self._stager = None
        if self.background:
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=cuda))
        self._staged: Future | None = None

    def save(self, tensors: dict[str, Any], buffers: set[str], **save_args: Any) -> Future:
        """Start DCP's ``async_save`` of ``tensors`` (the keys in ``buffers`` cloned now); its
        upload's future. The copy of the rest may still be running when this returns."""
        tensors = {key: value.detach().clone() if key in buffers else value for key, value in tensors.items()}
        if self._cuda:  # the stager's stream does not wait for ours: the step's last kernels finish first
            torch.cuda.current_stream().synchronize()
        if self._stager is None:
            return dcp.async_save(tensors, **save_args)
        response = dcp.async_save(tensors, async_stager=self._stager, **save_args)
        if isinstance(response, AsyncSaveResponse):
            self._staged = response.staging_completion
            return response.upload_completion
        return response

    def wait_before_step(self) -> float:
        """Block until the copy in flight (if any) is done; the milliseconds waited. Its error,
        if it failed, is raised by the upload's future instead (the write never starts)."""
        staged, self._staged = self._staged, None
        if staged is None or staged.done():
            return 0.0
        started = time.perf_counter()
        try:
            staged.result()
        except BaseException:  # noqa: BLE001 - reported once, by the upload that depends on it
            pass
        return (time.perf_counter() - started) * 1e3

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
