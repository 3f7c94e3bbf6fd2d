"""Callbacks: a fit-style recipe's hooks into distrun's loop (Keras's ``fit(callbacks=...)``).

A recipe's optional ``callbacks()`` returns a list of :class:`Callback` objects::

    from distrun.callbacks import EarlyStopping

    def callbacks():
        return [EarlyStopping(monitor="eval_loss", patience=2)]

Every rank runs every hook with the same figures: the step's loss is the global batch's mean
(reduced over the replicas, as the summary's ``final_loss`` is), the evaluation's metrics are
the reduced ones. So a callback written for one process decides the same on every rank. A hook
ends the run by setting ``state.stop = True`` (and ``state.reason``, what the summary says after
the callback's name); the ranks agree on it with one all-reduce after each step, so they stop
after the same step, evaluate and write the last checkpoint. An early-stopped run succeeds.

This module imports no torch: a callback is plain Python, and ``import distrun`` stays cheap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from distrun.errors import RecipeError

__all__ = ["Callback", "CallbackState", "EarlyStopping", "Progress"]


@dataclass(frozen=True)
class Progress:
    """The run's figures when a hook is called, the same on every rank.

    ``loss``: the newest step's loss, the global batch's mean (None before the first step);
    ``lr``: the learning rate that step used (the first parameter group's); ``eval_metrics``:
    the newest evaluation's, as the summary names them (``{"loss": ..., "accuracy": ...}``: a
    monitor's ``eval_loss`` is its ``loss``), empty before the first evaluation."""

    step: int
    epoch: int
    loss: float | None = None
    lr: float | None = None
    eval_metrics: Mapping[str, float] = field(default_factory=dict)
    total_steps: int | None = None


class CallbackState:
    """What a hook gets: the :class:`Progress` figures, read-only, and ``stop``, the one thing a
    hook may write (with ``reason``, said in the summary after the callback's class name).

    Keeping the best weights (``EarlyStopping(restore_best_weights=True)``) goes through
    :meth:`keep_weights` and :meth:`load_weights`: each rank copies only what it holds (a shard
    under sharded), so nothing is gathered."""

    __slots__ = ("_progress", "_weights", "stop", "reason")

    def __init__(self, progress: Progress, weights: Any = None) -> None:
        self._progress = progress
        self._weights = weights
        self.stop = False
        self.reason: str | None = None

    @property
    def step(self) -> int:
        return self._progress.step

    @property
    def epoch(self) -> int:
        return self._progress.epoch

    @property
    def loss(self) -> float | None:
        return self._progress.loss

    @property
    def lr(self) -> float | None:
        return self._progress.lr

    @property
    def eval_metrics(self) -> Mapping[str, float]:
        return MappingProxyType(dict(self._progress.eval_metrics))

    @property
    def total_steps(self) -> int | None:
        return self._progress.total_steps

    def keep_weights(self) -> Any:
        """A copy of this rank's model weights as they are now (an opaque object for ``load_weights``)."""
        if self._weights is None:
            raise RuntimeError("this hook has no model weights to keep")
        return self._weights.keep()

    def load_weights(self, kept: Any) -> None:
        """Put weights ``keep_weights`` copied back into the model."""
        if self._weights is None:
            raise RuntimeError("this hook has no model weights to load")
        self._weights.load(kept)

    def __repr__(self) -> str:
        return f"CallbackState({self._progress}, stop={self.stop})"


class _BadArgument(RecipeError, ValueError):
    """A callback built with an argument it cannot take: the recipe's error (exit 3, at the recipe's
    line), and a ValueError, as Keras raises."""


class Callback:
    """Base class of a recipe's callbacks: override the hooks you need; each gets a :class:`CallbackState`.

    ``on_train_begin`` once before the first step (also on ``--resume``), ``on_step_end`` after
    every step, ``on_eval_end`` after every evaluation (``--eval-every``, each epoch's end, the
    run's end), ``on_train_end`` once, after the run's last evaluation and before its last
    checkpoint. A hook that raises fails the job as the recipe's error (exit 3), naming the class."""

    def on_train_begin(self, state: CallbackState) -> None:
        """The run starts (its first step is ``state.step + 1``)."""

    def on_step_end(self, state: CallbackState) -> None:
        """Step ``state.step`` ended; ``state.loss`` is its global batch's mean loss."""

    def on_eval_end(self, state: CallbackState) -> None:
        """An evaluation at step ``state.step`` ended; ``state.eval_metrics`` are its figures."""

    def on_train_end(self, state: CallbackState) -> None:
        """The run ends: no step follows."""

    def state_dict(self) -> dict[str, Any] | None:
        """What to keep in every checkpoint (plain values: it is kept as JSON), given back to
        ``load_state_dict`` on ``--resume``; None (the default): nothing."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``--resume``: what ``state_dict`` returned when the checkpoint was written (before
        ``on_train_begin``)."""


_MODES: dict[str, Callable[[float, float, float], bool]] = {
    "min": lambda current, best, delta: current + delta < best,  # better by more than min_delta
    "max": lambda current, best, delta: current - delta > best,
}


class EarlyStopping(Callback):
    """Stop when an evaluation metric stops improving, as Keras's ``EarlyStopping`` does.

    The first evaluation sets the best; the run stops at the ``patience``-th evaluation in a row
    that fails to improve on it by more than ``min_delta`` (``patience=0``: at the first). With
    ``--eval-every 2`` and ``patience=2`` on a loss that rises, that is after step 6. ``monitor``
    names an evaluation metric: ``eval_loss``, or ``eval_<name>`` for a ``metrics()`` entry (with
    ``mode="max"`` for one that grows, such as accuracy). ``restore_best_weights``: at the run's
    end, put back the weights of the best evaluation (each rank keeps a copy of what it holds,
    in memory), so the last checkpoint holds them.

    Its count is in every checkpoint: after ``--resume`` it goes on (Lightning's choice; Keras
    starts it again). The best weights are not: after a resume it restores the best seen since."""

    def __init__(self, monitor: str = "eval_loss", patience: int = 0, min_delta: float = 0.0, mode: str = "min",
                 restore_best_weights: bool = False) -> None:
        if not isinstance(monitor, str) or not monitor.startswith("eval_") or monitor == "eval_":
            raise _BadArgument(f"EarlyStopping: monitor must name an evaluation metric, eval_loss or eval_<metric>. "
                             f"Received: {monitor!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise _BadArgument(f"EarlyStopping: patience must be a whole number >= 0. Received: {patience!r}")
        if mode not in _MODES:
            raise _BadArgument(f"EarlyStopping: mode must be 'min' or 'max'. Received: {mode!r}")
        self.monitor = monitor
        self.patience = patience
        self.min_delta = abs(float(min_delta))
        self.mode = mode
        self.restore_best_weights = bool(restore_best_weights)
        self._resumed = False
        self._reset()

    def _reset(self) -> None:
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0
        self.stopped_step: int | None = None
        self._best_weights: Any = None

    def on_train_begin(self, state: CallbackState) -> None:
        if not self._resumed:  # a fresh run starts counting; a resumed one goes on
            self._reset()

    def on_eval_end(self, state: CallbackState) -> None:
        key = self.monitor.removeprefix("eval_")
        metrics = state.eval_metrics
        if key not in metrics:
            raise ValueError(f"monitor {self.monitor!r} is not an evaluation metric; the evaluation gives: "
                             f"{', '.join('eval_' + name for name in sorted(metrics))}")
        current = float(metrics[key])
        if self.best is None and not math.isnan(current) or (
                self.best is not None and _MODES[self.mode](current, self.best, self.min_delta)):
            self.best, self.best_step, self.wait = current, state.step, 0
            if self.restore_best_weights:
                self._best_weights = state.keep_weights()
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_step = state.step
            state.stop = True
            evaluations = "evaluation" if self.wait == 1 else "evaluations"
            best = "none" if self.best is None else f"{self.best:.4g} at step {self.best_step}"
            state.reason = f"{self.monitor} did not improve for {self.wait} {evaluations} (best {best})"

    def on_train_end(self, state: CallbackState) -> None:
        if self.restore_best_weights and self._best_weights is not None and self.best_step != state.step:
            state.load_weights(self._best_weights)
        self._best_weights = None

    def state_dict(self) -> dict[str, Any]:
        """The count so far (distrun keeps it in every checkpoint; a custom loop may keep it in
        ``strategy.save(extra=...)``)."""
        return {"best": self.best, "best_step": self.best_step, "wait": self.wait}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.best_step, self.wait = state.get("best"), state.get("best_step"), int(state.get("wait", 0))
        self._best_weights, self._resumed = None, True
