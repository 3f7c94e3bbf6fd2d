"""How a model's and an optimizer's state split into tensors (for DCP) and everything else (JSON).

torch.distributed.checkpoint stores tensors well and anything else as a pickle it loads with
``weights_only=False``. So distrun gives DCP tensors only, under flat keys it chooses::

    model/<parameter or buffer name>          every tensor of the model's state_dict
    optim/<parameter name>/<state key>        every tensor of the optimizer's state (exp_avg, step...)

and keeps the rest (the optimizer's param_groups, any non-tensor state) in the checkpoint's
JSON sidecar. The optimizer state is keyed by parameter name (what
``get_optimizer_state_dict`` gives), so it does not depend on how the parameters were split
into groups or shards; ``indexed`` turns it into torch's own index-keyed layout, which the
plain format and ``optimizer.load_state_dict`` use.

Names never contain ``/`` (torch joins module names with ``.``), so the keys split back
unambiguously.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from distrun.errors import CheckpointError

__all__ = ["MODEL", "OPTIM", "split", "join", "indexed", "named"]

MODEL = "model/"
OPTIM = "optim/"


def split(model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors under flat keys, the JSON rest) of a model state_dict and a name-keyed optimizer
    state (``{"state": {name: {key: value}}, "param_groups": [...]}``; None: no optimizer)."""
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {"model": {}, "optimizer": None}
    for name, value in model_state.items():
        if isinstance(value, torch.Tensor):
            tensors[MODEL + name] = value
        else:
            rest["model"][name] = _jsonable(value, f"model state {name!r}")
    if optimizer_state is not None:
        scalars: dict[str, dict[str, Any]] = {}
        for name, state in optimizer_state.get("state", {}).items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{OPTIM}{name}/{key}"] = value
                else:
                    scalars.setdefault(name, {})[key] = _jsonable(value, f"optimizer state {name}.{key}")
        groups = [_jsonable(group, "optimizer param_groups") for group in optimizer_state.get("param_groups", [])]
        rest["optimizer"] = {"state": scalars, "param_groups": groups}
    return tensors, rest


def join(tensors: dict[str, Any], rest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``split``'s inverse: (model state_dict, name-keyed optimizer state or None)."""
    model = {key[len(MODEL):]: value for key, value in tensors.items() if key.startswith(MODEL)}
    model.update(rest.get("model") or {})
    saved = rest.get("optimizer")
    if saved is None:
        return model, None
    state: dict[str, dict[str, Any]] = {name: dict(values) for name, values in saved.get("state", {}).items()}
    for key, value in tensors.items():
        if key.startswith(OPTIM):
            name, _, entry = key[len(OPTIM):].rpartition("/")
            state.setdefault(name, {})[entry] = value
    return model, {"state": state, "param_groups": [dict(group) for group in saved.get("param_groups", [])]}


def indexed(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state in torch's layout: state keyed by each parameter's position
    in the groups, as ``optimizer.state_dict()`` gives and ``load_state_dict`` takes."""
    if not optimizer_state:
        return {}
    order = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {"state": {index[name]: state for name, state in optimizer_state["state"].items() if name in index},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in optimizer_state["param_groups"]]}


def named(optimizer_state: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """``indexed``'s inverse, given the parameter names in the optimizer's order."""
    if not optimizer_state:
        return {}
    try:
        return {"state": {order[int(i)]: value for i, value in optimizer_state.get("state", {}).items()},
                "param_groups": [{**group, "params": [order[int(i)] for i in group["params"]]}
                                 for group in optimizer_state.get("param_groups", [])]}
    except IndexError:
        raise CheckpointError(f"the checkpoint's optimizer holds more parameters than this optimizer's "
                              f"{len(order)}") from None


def _jsonable(value: Any, what: str) -> Any:
    """``value`` as JSON would give it back (tuples become lists), or a CheckpointError naming it."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        raise CheckpointError(f"{what}: {type(value).__name__} is neither a tensor nor JSON; a sharded "
                              f"checkpoint stores only those") from None
