"""A replica's step settings (precision, compile) applied after a strategy has wrapped.

Every strategy's ``prepare`` ends here, so precision and compile mean the same thing
under each: the strategy decides where parameters live and how gradients meet
(``_wrap``), then ``ReplicaStep.finish`` compiles the result (DDP's order: wrap, then
compile) and, under fp16, installs the loss scaler. ``Strategy.run`` enters
``autocast()`` around each step, so a custom loop gets the precision from the flag alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distrun.strategies.step.compile import CompileRoot, CompileStats, CompileWatch, compile_model
from distrun.strategies.step.precision import LossScaler, ScaledOptimizer, attach_output_scaling, autocast

__all__ = ["StepSettings", "ReplicaStep"]


@dataclass(frozen=True)
class StepSettings:
    """``--precision``, ``--compile`` and ``--compile-mode`` as a strategy receives them."""

    precision: str = "fp32"
    compile: bool = False
    compile_mode: str = "default"
    clip_grad_norm: float | None = None  # --clip-grad-norm: the gradients' global norm, at most
    activation_checkpointing: str = "none"  # none | full | selective, on each unit (parallel/activation.py)
    accumulate: int = 1  # --accumulate: micro-batches per replica batch (step/accumulation.py)


class ReplicaStep:
    """Owns this replica's autocast, loss scaler and compile watch."""

    def __init__(self, settings: StepSettings, device: Callable[[], torch.device],
                 agree: Callable[[torch.Tensor], torch.Tensor], on_skip: Callable[[float], None]) -> None:
        self.settings = settings
        self._device = device
        self.scaler = LossScaler(agree, on_skip) if settings.precision == "fp16" else None
        self.watch = CompileWatch() if settings.compile else None

    def root(self, model: nn.Module) -> nn.Module:
        """Before the strategy wraps: under --compile, the frame compilation starts from."""
        return CompileRoot(model) if self.settings.compile else model

    def finish(self, model: nn.Module, optimizer: Any, *, unscale_in_step: bool = True,
               compile_whole: bool = True) -> tuple[nn.Module, Any]:
        """Compile and scale what the strategy's ``_wrap`` returned.

        ``unscale_in_step``: fp16 wraps the optimizer, whose ``step`` unscales the model's
        gradients and skips on overflow. A strategy whose gradients are not all in
        ``param.grad`` (parameter-server's embedding rows) says False and calls
        ``scaler.unscale_and_check`` itself. ``compile_whole``: False where the strategy compiled
        its own parts (sharded compiles each block before sharding it).
        """
        if self.settings.compile and compile_whole:
            model = compile_model(model, self.settings.compile_mode)
        if self.scaler is not None:
            attach_output_scaling(model, self.scaler)
            if optimizer is not None and unscale_in_step:
                optimizer = ScaledOptimizer(optimizer, list(model.parameters()), self.scaler)
        return model, optimizer

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return autocast(self._device(), self.settings.precision)

    def compile_progress(self) -> CompileStats | None:
        """New compiler figures since the last call (after a step), or None."""
        return self.watch.poll() if self.watch is not None else None

    def scaler_state(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_scaler_state(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
