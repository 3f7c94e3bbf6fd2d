"""Live progress for scripts distrun does not step: plain torchrun scripts, Lightning, Accelerate.

A script owns its loop, so distrun watches three things torch already exposes, and
changes nothing the script sees:

- **Steps**: torch's global optimizer step hook
  (``torch.optim.optimizer.register_optimizer_step_post_hook``), called after every
  ``Optimizer.step`` of any optimizer. Lightning and Accelerate step torch's optimizers
  underneath their wrappers, so their steps count too; a step Accelerate skips for
  gradient accumulation does not reach the optimizer and is not counted. A script with
  several optimizers (a GAN) counts the steps of the busiest one.
- **Loss**: the tensor that ``backward()`` was last called on (``Tensor.backward`` and
  ``torch.autograd.backward``, wrapped). Only a reference is kept. It is read (``.item()``)
  only when a step event goes out, at most once per ``--log-interval-s``, so there is no
  extra device sync per step. Where a script scales its loss (fp16's GradScaler), the
  figure is the scaled loss.
- **Samples**: what the script's DataLoaders yield on this rank, counted as the first
  dimension of each batch's first tensor (``_BaseDataLoaderIter.__next__``, wrapped).
  samples/s is that count over the time since the first step, times the world size.
  A script that feeds batches without a DataLoader shows steps and loss, and 0 samples/s.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import dataloader

from distrun.runtime._reporter import EventReporter
from distrun.strategies.data.plan import batch_len

__all__ = ["ScriptProgress"]


class ScriptProgress:
    """Installs the three hooks for one training process; ``reporter`` gets a step per optimizer step."""

    def __init__(self, reporter: EventReporter) -> None:
        self._reporter = reporter
        self._steps: Counter[int] = Counter()  # id(optimizer) -> its steps
        self._last_loss: torch.Tensor | None = None
        self._samples = 0
        self._samples_reported = 0
        self.first_step_at: float | None = None
        register_optimizer_step_post_hook(self._after_step)
        self._wrap_backward()
        self._wrap_dataloader()

    @property
    def steps(self) -> int:
        return max(self._steps.values(), default=0)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps[id(optimizer)] += 1
        step = self.steps
        if step == self._reporter.current_step:
            return  # another optimizer of the same step (a GAN's second one)
        if self.first_step_at is None:
            self.first_step_at = time.time()
        samples, self._samples_reported = self._samples - self._samples_reported, self._samples
        self._reporter.step(step, 0, self._last_loss, samples)

    def _wrap_backward(self) -> None:
        progress = self
        tensor_backward = torch.Tensor.backward
        autograd_backward = torch.autograd.backward

        def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.numel() == 1:
                progress._last_loss = self.detach()
            return tensor_backward(self, *args, **kwargs)

        def autograd(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
                progress._last_loss = tensors.detach()
            return autograd_backward(tensors, *args, **kwargs)

        torch.Tensor.backward = backward  # type: ignore[method-assign]
        torch.autograd.backward = autograd  # type: ignore[assignment]

    def _wrap_dataloader(self) -> None:
        progress = self
        original = dataloader._BaseDataLoaderIter.__next__

        def next_batch(self: Any) -> Any:
            batch = original(self)
            progress._samples += batch_len(batch)
            return batch

        dataloader._BaseDataLoaderIter.__next__ = next_batch  # type: ignore[method-assign]
