"""Applying a tensor-parallel plan: the split modules, and every other parameter replicated.

``parallelize_module`` turns each planned module's parameters into DTensors sharded over the
tensor-parallel ranks and inserts the collectives at its boundaries. Every module that holds
parameters and is not split is then made a ``Replicate`` DTensor module on the same mesh
(torchtitan's NoParallel): its inputs enter as replicated DTensors and its outputs leave as
plain tensors, so the recipe's forward sees ordinary tensors throughout, while every parameter
of the model is a DTensor of one root mesh. FSDP2, ``clip_grad_norm_`` and the foreach and
fused optimizers need that: a mix of DTensors and plain tensors is what fails
(``aten._foreach_norm got mixed torch.Tensor and DTensor``).

A module replicated this way must own all of its parameters' uses: one whose forward mixes
its own parameters with what its children return would meet a plain tensor with a DTensor, so
such a module (parameters of its own beside children with parameters) is refused, naming it.
The model must be on the meta device (every rank builds it there or moves it there), so the
split is local slicing of nothing: no rank sends anything until the initial values are
broadcast from rank 0 into the shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import parallelize_module

from distrun.errors import RecipeError
from distrun.strategies.parallel.plan import TensorPlan, style_object

__all__ = ["apply_tensor_parallel", "check_sequence_gradients"]

#: Two tensor-parallel ranks' gradients of one replicated parameter differing by more than this
#: (relative to its size) took different slices of the sequence: a module the plan left out.
_AGREE_RTOL = 1e-4


def apply_tensor_parallel(model: nn.Module, plan: TensorPlan, mesh: DeviceMesh, *,
                          sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """Split ``model`` (on the meta device) over ``mesh`` (1-D: the tensor-parallel ranks) by ``plan``."""
    if loss_parallel and "output" not in plan.styles.values():
        raise RecipeError("--loss-parallel: tp_plan names no \"output\" layer (the head whose logits the loss "
                          "reads); mark it \"output\"")
    split = {name: style_object(style, model.get_submodule(name), sequence_parallel=sequence_parallel,
                                loss_parallel=loss_parallel)
             for name, style in plan.styles.items()}
    split = {name: style for name, style in split.items() if style is not None}
    parallelize_module(model, mesh, split, src_data_rank=None)
    covered = set(split)
    for name, module in model.named_modules():
        if any(name == done or name.startswith(done + ".") for done in covered):
            continue
        own = [key for key, param in module.named_parameters(recurse=False) if not isinstance(param, DTensor)]
        if not own:
            continue
        if any(_holds_parameters(child) for child in module.children()):
            raise RecipeError(f"--tp: {name or 'the model'} holds parameters of its own ({', '.join(own)}) beside "
                              "submodules that hold more; distrun replicates whole leaf modules, so move them into "
                              "a submodule of their own (an nn.Embedding, or a small nn.Module)")
        _replicate(module, mesh)


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    distribute_module(module, mesh, None, input_fn=_inputs_replicated, output_fn=_outputs_local)


def _inputs_replicated(module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
    return tuple(DTensor.from_local(value, mesh, [Replicate()], run_check=False)
                 if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) else value
                 for value in inputs)


def _outputs_local(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    if isinstance(outputs, DTensor):
        return outputs.to_local()
    if isinstance(outputs, tuple):
        return tuple(value.to_local() if isinstance(value, DTensor) else value for value in outputs)
    return outputs


def check_sequence_gradients(parameters: Iterable[tuple[str, nn.Parameter]], group: dist.ProcessGroup) -> str | None:
    """``--sequence-parallel``, after the first backward: every parameter replicated over the
    tensor-parallel ranks must have the same gradient on each of them. A module the plan left out
    (a norm not marked ``sequence``) is replicated by distrun as if it saw the whole sequence, while
    it saw a slice: its gradient is then each rank's slice's, and the ranks would drift apart.
    Which module did, or None. Gradients torch marks ``Partial`` (a ``sequence`` module's, summed
    at the optimizer) are not compared."""
    for name, param in parameters:
        grad = param.grad
        if not isinstance(grad, DTensor) or grad.device_mesh.mesh_dim_names is None:
            continue
        names = grad.device_mesh.mesh_dim_names
        if "tp" not in names or not isinstance(grad.placements[names.index("tp")], Replicate):
            continue
        local = grad.to_local().detach().double().flatten()
        high, low = local.clone(), local.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        scale = float(torch.maximum(high.abs(), low.abs()).max()) if local.numel() else 0.0  # the same on every rank
        if local.numel() and float((high - low).abs().max()) > _AGREE_RTOL * max(scale, 1e-12):
            return name
    return None
