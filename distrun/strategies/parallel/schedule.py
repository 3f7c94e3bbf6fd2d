"""Running a replica's pipeline: torch's schedules for training, a plain forward pass for evaluation.

Training hands each step to a torch.distributed.pipelining schedule (GPipe, 1F1B, interleaved
1F1B, interleaved zero bubble, and the V-shaped ZBV and DualPipeV). The first stage feeds the replica's inputs (``batch[0]``), the
schedule splits them into microbatches, and the last stage computes the recipe's
``loss(outputs, batch)`` on each: its target is the microbatch's row numbers
(``torch.arange``, torchtitan's trick), so the loss sees the rows of the whole batch that the
microbatch holds, whatever the batch is made of.

A replica's last batch of an epoch may be short (the global batch does not divide the data),
and torch's schedules need equal microbatches of the size they first saw. The batch is padded
to its full size with copies of its last row, and the padding is given no weight: each
microbatch's loss is scaled so that the gradients are those of the recipe's mean loss over
the real rows times the batch weight, exactly as one-device's step (``_microbatch_loss``).
On the first step torch also calls the loss once on uninitialised tensors, to learn the
gradients' shapes; that call is not a microbatch, and the loss reported leaves it out.

Evaluation batches vary in size and need no backward, so evaluation does not use the
schedules: each rank runs its stages in order, receiving a stage's input from the rank before
and sending its output on (a shape header, then the tensor), or keeping it when the next stage
is its own (a V's turn). The last stage has the outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from distrun.errors import RecipeError
from distrun.strategies.parallel.pipeline import call_item

__all__ = ["Pipeline", "SCHEDULES"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
             "zero-bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
             "dualpipe-v": ScheduleDualPipeV}

#: Activations between stages in evaluation: the header carries the dtype's index here.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
_MAX_DIMS = 8
#: Tensors one stage may pass to the next (a tuple's), in evaluation's messages.
_MAX_TENSORS = 16


def _rows(value: Any, index: torch.Tensor) -> Any:
    """The rows ``index`` of every tensor in a batch (tensors, tuples, lists, dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value[index.to(value.device)]
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(item, index) for item in value)
    if isinstance(value, dict):
        return {key: _rows(item, index) for key, item in value.items()}
    return value


def _padded(value: Any, rows: int) -> Any:
    """Every tensor of a batch grown to ``rows`` rows with copies of its last row."""
    if isinstance(value, torch.Tensor):
        short = rows - value.shape[0]
        return torch.cat([value, value[-1:].expand(short, *value.shape[1:])]) if short > 0 else value
    if isinstance(value, (tuple, list)):
        return type(value)(_padded(item, rows) for item in value)
    if isinstance(value, dict):
        return {key: _padded(item, rows) for key, item in value.items()}
    return value


class Pipeline:
    """This rank's stages of one replica's pipeline and the schedule that runs them."""

    def __init__(self, parts: Sequence[tuple[int, nn.Module]], *, stages: int, device: torch.device,
                 group: dist.ProcessGroup, schedule: str, microbatches: int,
                 rank_of: Callable[[int], int] | None = None) -> None:
        """``parts``: (stage index, module) for each stage this rank holds, in order; ``rank_of``:
        the pipeline rank of a stage (default: looped, stage mod the ranks)."""
        self._parts = list(parts)
        self._rank_of = rank_of or (lambda stage: stage % dist.get_world_size(group))
        self._stages = stages
        self._device = device
        self._group = group
        self._microbatches = microbatches
        self._rows: int | None = None  # a replica's full batch (set_batch_rows): what a short one is padded to
        indices = [index for index, _ in self._parts]
        self.first, self.last = 0 in indices, stages - 1 in indices
        pipeline_stages = [PipelineStage(module, index, stages, device, group=group) for index, module in self._parts]
        cls = SCHEDULES[schedule]
        runs = pipeline_stages if len(pipeline_stages) > 1 else pipeline_stages[0]
        # scale_grads=False: each microbatch's loss carries its own weight. torch's default divides
        # every gradient by the microbatch count at the end of a step, which would also shrink what
        # an earlier --accumulate micro-batch left in .grad.
        self._schedule = cls(runs, n_microbatches=microbatches, loss_fn=self._microbatch_loss, scale_grads=False)
        self._step: dict[str, Any] = {}  # the batch being trained: what the loss of each microbatch needs

    def set_batch_rows(self, rows: int) -> None:
        """A replica's full batch, once the data is known: what a short batch is padded to."""
        self._rows = rows

    # -- training -------------------------------------------------------------

    def train_step(self, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor], weight: float,
                   check: Callable[[Any], None]) -> torch.Tensor:
        """Forward and backward of one replica batch; the loss (the mean over its real rows),
        on every rank of the pipeline."""
        if not isinstance(batch, (tuple, list)) or not batch:
            raise RecipeError("--pp: the first stage reads batch[0], so a batch must be a tuple or list "
                              f"(inputs, ...). Received: {type(batch).__name__}")
        real = int(batch[0].shape[0])
        if self._rows is None:  # no distributed dataset told it: every batch is full
            self._rows = real
        if real > self._rows:
            raise RecipeError(f"--pp: a batch of {real} rows, more than a replica's {self._rows}")
        full = _padded(batch, self._rows)
        self._step = {"batch": full, "real": real, "weight": weight, "loss_fn": loss_fn, "check": check, "sums": []}
        losses: list[torch.Tensor] = []
        args = (full[0],) if self.first else ()
        target = torch.arange(self._rows, device=self._device) if self.last else None
        self._schedule.step(*args, target=target, losses=losses if self.last else None)
        mean = torch.zeros((), dtype=torch.float64, device=self._device)
        if self.last:  # the last M calls: the first step's first call is torch's shape inference, on no data
            mean = torch.stack(self._step["sums"][-self._microbatches:]).sum() / real
        self._step = {}
        dist.all_reduce(mean, group=self._group)  # only the last stage held it: every rank reports it
        return mean.float()

    def _microbatch_loss(self, outputs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The loss of the microbatch holding ``rows`` of the batch, weighted so that the sum over
        microbatches is the batch weight times the mean over the real rows."""
        step = self._step
        kept = rows[rows < step["real"]]
        if kept.numel() == 0:  # all padding: no gradient, but a backward all the same
            return sum(value.sum() for value in (outputs if isinstance(outputs, tuple) else (outputs,))) * 0.0
        loss = step["loss_fn"](_rows(outputs, torch.nonzero(rows < step["real"]).flatten()), _rows(step["batch"], kept))
        step["check"](loss)
        step["sums"].append(loss.detach().double() * kept.numel())
        return loss * (step["weight"] * kept.numel() / step["real"])

    # -- evaluation -----------------------------------------------------------

    def forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The model's output for ``inputs`` on the last stage's ranks; None on the others."""
        x: Any = inputs if self.first else None
        mine = {index for index, _ in self._parts}
        for index, module in self._parts:
            if index > 0 and index - 1 not in mine:
                x = self._receive(self._peer(index - 1))
            x = call_item(module, x)
            if index < self._stages - 1 and index + 1 not in mine:
                self._send(x, self._peer(index + 1))
                x = None
        return x

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self._group, self._rank_of(stage))

    def _send(self, value: Any, to: int) -> None:
        """A stage's output to the next stage's rank: how many tensors (a tuple's, or 1), then for
        each a shape header and the tensor."""
        tensors = value if isinstance(value, tuple) else (value,)
        if not tensors or len(tensors) > _MAX_TENSORS or not all(
                isinstance(t, torch.Tensor) and t.dim() <= _MAX_DIMS and t.dtype in _DTYPES for t in tensors):
            raise RecipeError(f"--pp: a stage must give the next one a tensor, or a tuple of at most {_MAX_TENSORS} "
                              f"(each of at most {_MAX_DIMS} dimensions)")
        dist.send(torch.tensor([len(tensors), int(isinstance(value, tuple))], dtype=torch.int64, device=self._device),
                  dst=to, group=self._group)
        for tensor in tensors:
            header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64, device=self._device)
            header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            dist.send(header, dst=to, group=self._group)
            dist.send(tensor.detach().contiguous(), dst=to, group=self._group)

    def _receive(self, sender: int) -> Any:
        count = torch.zeros(2, dtype=torch.int64, device=self._device)
        dist.recv(count, src=sender, group=self._group)
        tensors = []
        for _ in range(int(count[0])):
            header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64, device=self._device)
            dist.recv(header, src=sender, group=self._group)
            dims = int(header[0])
            tensor = torch.empty([int(size) for size in header[2:2 + dims]], dtype=_DTYPES[int(header[1])],
                                 device=self._device)
            dist.recv(tensor, src=sender, group=self._group)
            tensors.append(tensor)
        return tuple(tensors) if int(count[1]) else tensors[0]
