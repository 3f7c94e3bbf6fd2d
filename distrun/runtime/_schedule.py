"""The recipe's learning-rate schedule: ``scheduler(optimizer)``, stepped once per applied update.

Why it is built here, after ``strategy.prepare``, and not beside ``optimizer(params)``: sharded,
``--tp`` and ``--pp`` rebuild the recipe's optimizer on their pieces, and ``--pp`` makes one per
stage. A scheduler built on the recipe's object would change the lr of an optimizer nobody
steps. So the recipe's ``scheduler`` is called once per optimizer the strategy really steps
(``strategy.lr_optimizers()``), and they are stepped together.

Under parameter-server the scheduler is each worker's, on the recipe's optimizer it keeps: it
moves once per push of that worker, and each push carries the worker's lr to the ps tasks,
which apply it at that lr.

Why it counts *applied* updates: a step the fp16 loss scaler or ``--on-nonfinite skip`` skips
changes no parameter, so the schedule does not move either (Lightning's and HF's choice: the
lr follows the updates). A step post-hook on each stepped optimizer says whether it ran.

``ReduceLROnPlateau`` is the exception: it is stepped with an evaluation's metric
(``eval_loss``, or the recipe's ``scheduler_monitor``) after each evaluation, never per step.

Its state travels in every checkpoint (``lr_scheduler``), so a resume on another layout goes
on at the step it left; the lr of each group is set back from it, whatever the optimizer's own
state carried.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from distrun.errors import RecipeError

__all__ = ["LrSchedule", "build_schedule"]


class LrSchedule:
    """One recipe scheduler per stepped optimizer (one, except for ``--pp`` stages), moved together."""

    def __init__(self, schedulers: list[Any], optimizers: list[torch.optim.Optimizer], monitor: str) -> None:
        self.schedulers = schedulers
        self.plateau = isinstance(schedulers[0], ReduceLROnPlateau)
        self.monitor = monitor
        self._updates = 0  # applied optimizer steps seen since the last ``after_step``
        for optimizer in optimizers:  # several stage optimizers step once each per update
            optimizer.register_step_post_hook(self._count)
        self._per_update = max(len(optimizers), 1)
        self._watched = bool(optimizers)

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._updates += 1

    def after_step(self, allowed: bool) -> None:
        """The step's end: move the schedule if its update was applied (seen by the hooks; where
        this replica steps no optimizer itself, the loop's ``allowed``)."""
        applied = self._updates >= self._per_update if self._watched else allowed
        self._updates = 0
        if applied and not self.plateau:
            with _quiet_order_warning():
                for scheduler in self.schedulers:
                    scheduler.step()

    def after_eval(self, metrics: dict[str, float]) -> None:
        """ReduceLROnPlateau: one step with the monitored metric of this evaluation."""
        if not self.plateau:
            return
        if self.monitor not in metrics:
            raise RecipeError(f"scheduler_monitor = 'eval_{self.monitor}' is not an evaluation metric; the "
                              f"evaluation gives: {', '.join('eval_' + name for name in sorted(metrics))}")
        for scheduler in self.schedulers:
            scheduler.step(metrics[self.monitor])

    @property
    def lr(self) -> float:
        return float(self.schedulers[0].optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()  # every stage's is the same

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """A checkpoint's ``lr_scheduler``; without one (a checkpoint of a run with no schedule, or
        from before schedules were saved) a per-step schedule is moved on ``step`` updates."""
        for scheduler in self.schedulers:
            if state is not None:
                scheduler.load_state_dict(dict(state))
            elif not self.plateau:
                with _quiet_order_warning():
                    for _ in range(step):
                        scheduler.step()
            # The lr the schedule is at, whatever the optimizer's state put in its groups.
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr


@contextlib.contextmanager
def _quiet_order_warning() -> Iterator[None]:
    """torch warns of a scheduler stepped before its optimizer: true of a schedule caught up on
    resume, and of one on an optimizer this replica never steps (central-storage's non-chief
    replicas), both on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        yield


def build_schedule(recipe: ModuleType, strategy: Any, spec: Any, recipe_optimizer: Any) -> LrSchedule | None:
    """The recipe's ``scheduler(optimizer)`` on each optimizer ``strategy`` steps; None without one."""
    make = getattr(recipe, "scheduler", None)
    if make is None:
        return None
    if not callable(make):
        raise RecipeError(f"{spec.recipe}: scheduler must be a function scheduler(optimizer) -> "
                          f"torch.optim.lr_scheduler.LRScheduler. Received: {type(make).__name__}")
    stepped = strategy.lr_optimizers()
    # A replica that steps none itself (central-storage's non-chief replicas) schedules the recipe's
    # own: its lr is only shown, the chief's schedule is the one that trains.
    targets = stepped or ([recipe_optimizer] if isinstance(recipe_optimizer, torch.optim.Optimizer) else [])
    if not targets:
        raise RecipeError(f"{spec.recipe}: scheduler() needs a torch.optim.Optimizer; optimizer() returned "
                          f"a {type(recipe_optimizer).__name__}")
    schedulers = [_checked(make(optimizer), make) for optimizer in targets]
    monitor = getattr(recipe, "scheduler_monitor", "eval_loss")
    if not isinstance(monitor, str):
        raise RecipeError(f"{spec.recipe}: scheduler_monitor must be a metric's name. Received: {monitor!r}")
    schedule = LrSchedule(schedulers, stepped, _metric_key(monitor))
    if schedule.plateau and not hasattr(recipe, "eval_data"):
        raise _at(RecipeError("scheduler() returned ReduceLROnPlateau, which distrun steps with an evaluation's "
                              f"{monitor}; the recipe has no eval_data, so it would never move"), make)
    _check_plain(schedule.state_dict(), make)
    return schedule


def _metric_key(monitor: str) -> str:
    """``eval_loss`` and ``eval_accuracy`` name the evaluation's ``loss`` and ``accuracy``."""
    return monitor.removeprefix("eval_")


def _checked(scheduler: Any, make: Any) -> Any:
    if isinstance(scheduler, (LRScheduler, ReduceLROnPlateau)):
        return scheduler
    raise _at(RecipeError(f"scheduler() returned {type(scheduler).__name__}; it must return a "
                          "torch.optim.lr_scheduler.LRScheduler built on the optimizer it is given"), make)


def _check_plain(state: dict[str, Any], make: Any) -> None:
    """A sharded checkpoint keeps the schedule's state as JSON beside its tensors: plain values only."""
    try:
        json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise _at(RecipeError(f"scheduler(): its state_dict() holds a value a checkpoint cannot keep ({exc}); "
                              "use functions (not callable objects) for LambdaLR's lr_lambda"), make) from None


def _at(error: RecipeError, make: Any) -> RecipeError:
    code = getattr(make, "__code__", None)
    if code is not None:
        error.recipe_location = (code.co_filename, code.co_firstlineno)  # type: ignore[attr-defined]
    return error
