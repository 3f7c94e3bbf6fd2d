"""The evaluator task: evaluate one checkpoint on the recipe's eval_data, report, exit.

TensorFlow's evaluator role, beside the training and off its critical path: the
workers never wait for it. It builds the recipe's model on one device, loads the
checkpoint's parameters (``weights_only``), and computes the same loss and
metrics the fit loop computes at the end of an epoch, so its figures can be
compared with the training's own.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from distrun.config import JobSpec
from distrun.errors import RecipeError
from distrun.runtime._fit import _default_forward
from distrun.strategies import InputContext, Strategy
from distrun.strategies.checkpoint import load_checkpoint


def evaluate_checkpoint(recipe: ModuleType, strategy: Strategy, spec: JobSpec, path: str,
                        emit_eval: Any) -> dict[str, float]:
    if not hasattr(recipe, "eval_data"):
        raise RecipeError(f"{spec.recipe}: the evaluator needs eval_data(ctx) in the recipe")
    from distrun.runtime._metrics import evaluate

    global_batch_size = spec.training.global_batch_size or 32
    ctx = InputContext(1, 0, global_batch_size, spec.training.seed)
    torch.manual_seed(spec.training.seed)
    with strategy.scope():
        model = recipe.model()
        optimizer = recipe.optimizer(model.parameters())
    strategy.prepare(model, optimizer)
    data = load_checkpoint(path)
    strategy.unwrap().load_state_dict(data["model"])
    make_metrics = getattr(recipe, "metrics", None)
    result = evaluate(strategy, recipe.eval_data(ctx), forward=getattr(recipe, "forward", _default_forward),
                      loss_fn=recipe.loss, metrics=make_metrics() if make_metrics else {},
                      per_replica_batch_size=global_batch_size)
    emit_eval(int(data.get("step", 0)), int(data.get("epoch", 0)), result)
    return result
