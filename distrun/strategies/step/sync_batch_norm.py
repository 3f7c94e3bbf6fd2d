"""``--sync-batch-norm`` on every device: BatchNorm over the global batch, not each replica's share.

torch's ``SyncBatchNorm`` runs only on GPU-like devices (its kernels are CUDA ones, and
its forward raises ``SyncBatchNorm expected input tensor to be on GPU`` elsewhere), so a
mirrored job on CPU with ``--sync-batch-norm`` crashed. On CUDA ``convert`` keeps torch's
module (its fused kernels); on CPU it puts in ``CpuSyncBatchNorm``, which computes the same
thing with plain tensor ops and gloo:

* forward: each replica sums its share per channel (sum, sum of squares, count), ONE
  all-reduce makes them global, and the batch is normalised with the global mean and
  variance. The running statistics take the global ones (unbiased variance), as a
  one-device BatchNorm over the whole batch would.
* backward (``_SyncBatchNormFn``): as torch's SyncBatchNorm, the two per-channel gradient
  terms (sum of dy, sum of dy * (x - mean)) are all-reduced, because every sample's output
  depends on every replica's inputs through the shared statistics. The gradients of the
  affine weight and bias stay local: DDP averages them like any parameter's.

So mirrored x N with ``--sync-batch-norm`` trains to one-device's parameters on a model
with BatchNorm (tests/integration/test_sync_batch_norm.py). The sums are accumulated in
float64 so that ``E[x^2] - E[x]^2`` does not lose the variance to cancellation.

A padded last batch (a replica whose share is short gets samples of loss weight 0) still
counts the padding in the statistics: only the loss weighting knows which samples are padding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

__all__ = ["CpuSyncBatchNorm", "convert"]


def convert(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` with its BatchNorm layers synchronised over the default process group."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _convert_cpu(model)


def _convert_cpu(module: nn.Module) -> nn.Module:
    """torch's ``convert_sync_batchnorm``, putting in ``CpuSyncBatchNorm``: same keys, same state."""
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, CpuSyncBatchNorm):
        out = CpuSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, _convert_cpu(child))
    return out


class CpuSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm of any dimension (N, C, *) whose training statistics are the global batch's.

    Not an ``nn.SyncBatchNorm`` subclass: DDP refuses any of those on a CPU module
    (``SyncBatchNorm layers only work with GPU modules``). Its state dict has BatchNorm's keys,
    so checkpoints load into the recipe's unconverted model."""

    process_group: Any = None  # the default group, as it is at each step (--elastic replaces it)

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002 (torch's name)
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torch's name)
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        if not (self.training and batch_stats and group is not None and dist.get_world_size(group) > 1):
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, batch_stats,
                                factor, self.eps)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, running_mean, running_var,
                                      self.eps, factor, group)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *) as (M, C): one row per value a channel sees."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).t()


def _per_channel(x: torch.Tensor) -> list[int]:
    """The shape that broadcasts a (C,) vector over (N, C, *)."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class _SyncBatchNormFn(torch.autograd.Function):
    """Batch norm over every replica's batch: statistics all-reduced forward, gradient terms backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                eps: float, factor: float, group: Any) -> torch.Tensor:
        rows = _channels_last(x)
        local = torch.cat([rows.sum(0, dtype=torch.float64), rows.square().sum(0, dtype=torch.float64),
                           torch.tensor([rows.shape[0]], dtype=torch.float64, device=x.device)])
        dist.all_reduce(local, group=group)
        channels = x.shape[1]
        count = local[-1]
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(count)} "
                             "over all replicas")
        mean64 = local[:channels] / count
        var64 = (local[channels:2 * channels] / count - mean64.square()).clamp_min(0)
        mean, invstd = mean64.to(x.dtype), torch.rsqrt(var64 + eps).to(x.dtype)
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_(mean64.to(running_mean.dtype), alpha=factor)
        if running_var is not None:
            unbiased = var64 * count / (count - 1)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        shape = _per_channel(x)
        y = (x - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.group, ctx.has_bias = float(count), group, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        shape = _per_channel(x)
        xmu = x - mean.view(shape)
        dims = [0] + list(range(2, x.dim()))
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_weight = sum_dy_xmu * invstd if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.clone() if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            # Every replica's samples moved the statistics: the terms are summed over all of them.
            terms = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(terms, group=ctx.group)
            channels = x.shape[1]
            mean_dy = (terms[:channels] / ctx.count).view(shape)
            mean_dy_xmu = (terms[channels:] / ctx.count).view(shape)
            scale = invstd.view(shape) if weight is None else (invstd * weight).view(shape)
            grad_x = (dy - mean_dy - xmu * invstd.view(shape).square() * mean_dy_xmu) * scale
        return grad_x, grad_weight, grad_bias, None, None, None, None, None
