"""``--clip-grad-norm MAX``: the gradients' global norm clipped to MAX before every optimizer step.

The clip is a step pre-hook on the optimizer that really steps, so it sees the gradients
that step uses, under every strategy: mirrored's after DDP's all-reduce (the same on every
replica), central-storage's on the chief after the reduce, sharded's over the shards
(``clip_grad_norm_`` on DTensor gradients computes the norm of the whole, one all-reduce),
and under fp16 after the loss scaler has unscaled them (its optimizer calls the inner
step only then).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clip_before_step"]


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float) -> Any:
    """Clip the global norm of ``optimizer``'s gradients to ``max_norm`` before each of its steps."""

    def clip(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        if params:
            torch.nn.utils.clip_grad_norm_(params, max_norm)

    return optimizer.register_step_pre_hook(clip)
