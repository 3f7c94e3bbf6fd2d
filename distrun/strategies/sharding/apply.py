"""FSDP2 over a model's units, then its root; the recipe's optimizer rebuilt on the shards.

After torchtitan's ``apply_fsdp``: ``fully_shard`` each unit, then the root, on one mesh
with one mixed-precision policy. The last unit is not resharded after forward: backward
needs it at once, so freeing and gathering it again would be wasted work.

``fully_shard`` replaces each parameter with a sharded one (a DTensor) under the same
name. An optimizer built before holds the old tensors, so it is rebuilt: the same class,
the same groups and hyperparameters (every per-group option, the recipe's own keys too), each
group's parameters found again by name. What the recipe set on the object is carried over:
its hooks (a step pre-hook that sets the lr is a schedule) and attributes the constructor does
not set. A ``step`` or ``zero_grad`` replaced on the object would still act on the old tensors,
so it is refused in one line, never dropped.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from distrun.errors import RecipeError

__all__ = ["apply_fsdp", "rebuild_optimizer", "parameter_names", "reshard_all"]


def apply_fsdp(model: nn.Module, units: tuple[nn.Module, ...], mesh: DeviceMesh, *,
               param_dtype: torch.dtype | None, reshard_after_forward: bool, offload: bool) -> nn.Module:
    """Shard ``units`` one by one, then the root. ``param_dtype``: what parameters are gathered
    and computed in (None: their own); gradients are always reduced in fp32."""
    def policy(output_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, output_dtype=output_dtype)

    options: dict[str, Any] = {"mesh": mesh}
    if offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for index, unit in enumerate(units):  # a unit's output stays in param_dtype, for the next layer
        fully_shard(unit, reshard_after_forward=reshard_after_forward and index < len(units) - 1,
                    mp_policy=policy(None), **options)
    # The model's output reaches the recipe's loss in fp32, as autocast would leave a loss.
    fully_shard(model, reshard_after_forward=reshard_after_forward,
                mp_policy=policy(torch.float32 if param_dtype is not None else None), **options)
    return model


def reshard_all(model: nn.Module) -> None:
    """Free every gathered unit. A forward without backward (evaluation) leaves the units that
    do not reshard after forward gathered: their parameters are then whole tensors, not the
    shards the optimizer steps, until the next backward. Checkpoints and training need the shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name, taken before sharding replaces the tensors."""
    return {id(param): name for name, param in model.named_parameters()}


def rebuild_optimizer(optimizer: Any, model: nn.Module, names: dict[int, str], *, part: bool = False) -> Any:
    """``optimizer``'s class, groups and hyperparameters over ``model``'s sharded parameters.
    ``part``: ``model`` is one pipeline stage, holding some of the optimizer's parameters; each
    group keeps those (a group may end empty: the groups stay in step with the whole model's)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise RecipeError(f"--strategy sharded rebuilds the optimizer on the sharded parameters, so it must be a "
                          f"torch.optim.Optimizer. Received: {type(optimizer).__name__}")
    if any(optimizer.state.values()):
        raise RecipeError("--strategy sharded: the optimizer already has state; build it, then prepare, then step")
    sharded = dict(model.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        try:
            params = [sharded[names[id(param)]] for param in group["params"]
                      if not part or names.get(id(param)) in sharded]
        except KeyError:
            raise RecipeError("--strategy sharded: the optimizer holds a tensor that is not one of the model's "
                              "parameters") from None
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    # ``defaults`` may hold what the constructor sets itself (AdamW's decoupled_weight_decay): pass
    # only what it takes; each group already carries every value.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    _refuse_replaced_methods(optimizer)
    rebuilt = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if open_ended or k in accepted})
    _carry_over(optimizer, rebuilt)
    return rebuilt


#: The optimizer's own hook tables (``register_step_pre_hook`` and the rest): carried over in order.
_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
          "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
          "_optimizer_load_state_dict_post_hooks")


def _refuse_replaced_methods(optimizer: torch.optim.Optimizer) -> None:
    """A method set on the instance (a wrapper around the old ``step``, or what an lr scheduler
    built on it installs) is bound to the old tensors: carrying it would step those."""
    for name in ("step", "zero_grad"):
        if name not in vars(optimizer):
            continue
        if getattr(vars(optimizer)[name], "_wrapped_by_lr_sched", False):
            raise RecipeError("the optimizer has an lr scheduler built on it, which distrun's rebuilt optimizer "
                              "(on the sharded parameters) would not follow; define scheduler(optimizer) in the "
                              "recipe instead, and distrun builds it on the optimizer it steps")
        raise RecipeError(f"the optimizer's {name} was replaced on the object; distrun rebuilds the optimizer on "
                          f"the sharded parameters and cannot carry a replaced {name} over: use "
                          "register_step_pre_hook/register_step_post_hook, or a subclass")


def _carry_over(old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """The recipe's hooks and its own attributes on ``old``, onto ``new``. Hooks are called with
    the optimizer that steps, so a hook that reads its ``optimizer`` argument acts on ``new``."""
    for table in _HOOKS:
        hooks = getattr(old, table, None)
        if hooks:
            getattr(new, table).update(hooks)
    for name, value in vars(old).items():
        if name not in vars(new):  # set by the recipe, not by the constructor
            setattr(new, name, value)
