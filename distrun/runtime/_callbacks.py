"""The fit loop's side of the recipe's ``callbacks()`` (the recipe's side: ``distrun/callbacks.py``).

Why the figures are reduced before a hook sees them: every rank runs the hooks, and a callback
written for one process (EarlyStopping comparing losses) must decide the same everywhere. The
step's loss is the global batch's mean (one scalar all-reduce, as ``final_loss`` is computed);
the evaluation's metrics already are the reduced ones. Why the stop is agreed anyway: a
callback may look at something only its rank sees (a clock, a file). The ranks put their
``stop`` into one MAX all-reduce over every rank after each step (as a preemption warning is
agreed, ``runtime/_preempt.py``), so they all stop after the same step. Both collectives run
only when the recipe has callbacks.

The reason a run stopped travels in the ranks' ``Done`` events (each rank says the callback
that stopped it, if one did), so the summary names the callback and what it watched.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from distrun.callbacks import Callback, CallbackState, Progress
from distrun.errors import RecipeError

__all__ = ["CallbackRunner", "build_callbacks"]


class _Weights:
    """``CallbackState.keep_weights``/``load_weights``: this rank's tensors of the model, copied
    where they are (a shard stays a shard; under central-storage the central copy, which the
    checkpoint stores)."""

    def __init__(self, module: Callable[[], torch.nn.Module]) -> None:
        self._module = module
        self.loaded = False  # weights were put back: the last checkpoint must be written again

    def keep(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().clone() for name, tensor in self._module().state_dict().items()}

    @torch.no_grad()
    def load(self, kept: dict[str, torch.Tensor]) -> None:
        for name, tensor in self._module().state_dict().items():
            tensor.copy_(kept[name])
        self.loaded = True


class CallbackRunner:
    """The recipe's callbacks, each hook run on every rank with the same figures, and the stop
    the ranks agree on. ``reason``: what this rank's callback said when it stopped the run."""

    def __init__(self, callbacks: list[Callback], strategy: Any, reporter: Any, recipe: str,
                 made_at: tuple[str, int] | None) -> None:
        self._callbacks = callbacks
        self._reporter = reporter
        self._strategy = strategy
        self._recipe = recipe
        self._made_at = made_at
        self._weights = _Weights(strategy.unwrap)
        self._wants_stop = False  # a hook on this rank set stop since the last agreement
        self.stopped = False  # the ranks agreed to stop
        self.reason: str | None = None
        self.loss: float | None = None
        self.lr: float | None = None
        self.eval_metrics: dict[str, float] = {}
        self.total_steps: int | None = None

    # the hooks ---------------------------------------------------------------

    def train_begin(self) -> None:
        self._call("on_train_begin")

    def step_end(self, loss: Any, lr: float | None) -> None:
        """After each step: ``loss`` is this replica's, weighted by ``batch_weight`` into the global mean."""
        strategy = self._strategy
        local = float(loss) * strategy.batch_weight if loss is not None else 0.0
        self.loss, self.lr = float(strategy.reduce("mean", local)), lr
        self._call("on_step_end")

    def eval_end(self, metrics: dict[str, float]) -> None:
        self.eval_metrics = dict(metrics)
        self._call("on_eval_end")

    def train_end(self) -> None:
        self._call("on_train_end")

    def agreed_stop(self) -> bool:
        """Did a hook on any rank set ``stop``? One MAX all-reduce over every rank (a --tp/--pp
        replica's other ranks must stop too); every rank calls it at the same points."""
        if not self.stopped and self._strategy._any_true(self._wants_stop):
            self.stopped = True
        self._wants_stop = False
        return self.stopped

    def checkpoint_state(self) -> dict[str, Any]:
        """Every checkpoint's ``extra``: each callback's ``state_dict()`` by its place in the list."""
        states = {str(index): callback.state_dict() for index, callback in enumerate(self._callbacks)}
        return {"callbacks": {index: state for index, state in states.items() if state is not None}}

    def load_state(self, extra: dict[str, Any] | None) -> None:
        """``--resume``: give each callback the state the checkpoint kept for it (by its place)."""
        states = (extra or {}).get("callbacks") or {}
        for index, callback in enumerate(self._callbacks):
            if str(index) in states:
                try:
                    callback.load_state_dict(states[str(index)])
                except Exception as exc:  # noqa: BLE001 - the recipe's callback
                    raise self._failed(callback, "load_state_dict", exc) from exc

    @property
    def weights_loaded(self) -> bool:
        """A hook put kept weights back (EarlyStopping's restore_best_weights)."""
        return self._weights.loaded

    # ---------------------------------------------------------------------------

    def _call(self, hook: str) -> None:
        strategy = self._strategy
        progress = Progress(step=strategy.step, epoch=strategy.epoch, loss=self.loss, lr=self.lr,
                            eval_metrics=dict(self.eval_metrics), total_steps=self.total_steps)
        before = self._reporter.during  # a failure here is not "at step N+1": the step ended
        self._reporter.during = f"running the callbacks' {hook} at step {strategy.step}"
        for callback in self._callbacks:
            state = CallbackState(progress, self._weights)
            try:
                getattr(callback, hook)(state)
            except Exception as exc:  # noqa: BLE001 - any failure in a callback is the recipe's
                raise self._failed(callback, hook, exc) from exc
            if state.stop and not self._wants_stop and not self.stopped:
                self._wants_stop = True
                said = f": {state.reason}" if state.reason else f" stopped the run at step {strategy.step}"
                self.reason = self.reason or f"{type(callback).__name__}{said}"
        self._reporter.during = before

    def _failed(self, callback: Callback, hook: str, exc: Exception) -> RecipeError:
        said = str(exc).strip().splitlines()
        error = RecipeError(f"callback {type(callback).__name__} raised in {hook}: {type(exc).__name__}"
                            + (f": {said[0]}" if said else ""))
        where = _recipe_frame(exc, self._recipe) or self._made_at
        if where is not None:
            error.recipe_location = where  # type: ignore[attr-defined]
        return error


def _recipe_frame(exc: BaseException, recipe: str) -> tuple[str, int] | None:
    """The innermost frame of the recipe's own file in ``exc``'s traceback (a hook it wrote)."""
    import os

    folder = os.path.dirname(os.path.abspath(recipe))
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.dirname(os.path.abspath(frame.filename)) == folder and frame.lineno is not None:
            found = (frame.filename, frame.lineno)
    return found


def build_callbacks(recipe: ModuleType, strategy: Any, spec: Any, reporter: Any) -> CallbackRunner | None:
    """The recipe's ``callbacks()``, checked; None without one (the loop then adds no collective)."""
    make = getattr(recipe, "callbacks", None)
    if make is None:
        return None
    code = getattr(make, "__code__", None)
    made_at = (code.co_filename, code.co_firstlineno) if code is not None else None
    if not callable(make):
        raise RecipeError(f"{spec.recipe}: callbacks must be a function callbacks() -> list of "
                          f"distrun.callbacks.Callback. Received: {type(make).__name__}")
    if spec.strategy.name.value == "parameter-server":
        raise _at(RecipeError("callbacks() need replicas that step together, so that every rank stops after the "
                              "same step; parameter-server workers step on their own"), made_at)
    try:
        made = make()
    except RecipeError as exc:  # EarlyStopping's arguments, say: said at the recipe's line, as RecipeError
        raise _at(RecipeError(exc.message), _recipe_frame(exc, spec.recipe) or made_at) from None
    if not isinstance(made, (list, tuple)) or not all(isinstance(item, Callback) for item in made):
        stray = None if not isinstance(made, (list, tuple)) else next(i for i in made if not isinstance(i, Callback))
        got = type(made).__name__ if stray is None else f"a {type(made).__name__} holding a {type(stray).__name__}"
        raise _at(RecipeError(f"callbacks() returned {got}; it must return a list of distrun.callbacks.Callback "
                              "objects (from distrun.callbacks import Callback, EarlyStopping)"), made_at)
    return CallbackRunner(list(made), strategy, reporter, spec.recipe, made_at) if made else None


def _at(error: RecipeError, where: tuple[str, int] | None) -> RecipeError:
    if where is not None:
        error.recipe_location = where  # type: ignore[attr-defined]
    return error
