"""Model parallel (``--tp N``, ``--pp P``): each replica split over N x P ranks, replicas mirrored or sharded.

``--strategy mirrored --tp 2 --replicas 2`` runs 4 ranks: two replicas, each of two ranks that
split every planned layer (``parallel/plan.py``). ``--pp 2`` cuts each replica's layer chain
into two pipeline stages on two ranks (``parallel/pipeline.py``), run by one of torch's
schedules (``parallel/schedule.py``). The data-parallel dimension is FSDP2's, as in
torchtitan: each stage's blocks are ``fully_shard``-ed over the mesh's ``(dp_replicate,
dp_shard)`` slice. Mirrored replicates over every data-parallel rank (a shard dimension of 1:
HSDP with nothing to shard, gradients all-reduced), sharded shards over them (``--shard-within
host``: HSDP inside each host). DDP is not used: it cannot hold DTensor parameters, and FSDP2
over a slice of the same mesh is what composes with tensor and pipeline parallel
(``parallel/mesh.py``).

The order is torchtitan's: the model is built on the meta device on every rank but 0 (rank 0
builds it on the CPU for the seeded initial values, and keeps it until the first step to check
the pipeline's chain on a real batch), each rank keeps its pipeline stages, tensor parallel
splits them, activation checkpointing wraps each block (``Strategy.prepare``), ``--compile``
compiles each block, FSDP2 shards the blocks and each stage's root, each rank allocates its
pieces, and rank 0's initial values are broadcast into them. So every rank starts from
one-device's parameters, and after each step holds its pieces of one-device's parameters.

Everything else is sharded's: checkpoints are DCP folders under the model's own parameter names
(every stage saves under the whole model's names, so any layout reads them: one-device,
mirrored, sharded at any rank count, another --tp/--pp), the optimizer is rebuilt on the pieces,
``--precision`` is FSDP's mixed-precision policy. A replica is several ranks, so ``num_replicas``
and ``replica_id`` count replicas, each rank of a replica reads the same batches, and
``reduce``/``gather`` run over one rank per replica.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from distrun.config._parallel import rank_of_stage, stages_of_rank, stages_per_rank
from distrun.errors import ConfigError, RecipeError
from distrun.strategies.checkpoint import layout
from distrun.strategies.parallel.mesh import MeshShape, ParallelMesh, mesh_shape
from distrun.strategies.parallel.parts import PipelineOptimizer, PipelineParts, merge_rest, restricted
from distrun.strategies.parallel.pipeline import Chain, chain_of, check_chain, cut_chain, keep_stages, meta_copy
from distrun.strategies.parallel.plan import TensorPlan, resolve_plan
from distrun.strategies.parallel.plan_check import PlanCheck
from distrun.strategies.parallel.schedule import Pipeline
from distrun.strategies.parallel.tensor import apply_tensor_parallel, check_sequence_gradients
from distrun.strategies.sharded import ShardedStrategy
from distrun.strategies.checkpoint.layout import MODEL as MODEL_PREFIX
from distrun.strategies.sharding.apply import apply_fsdp, parameter_names, rebuild_optimizer
from distrun.strategies.sharding.checkpoint import load_sharded, sharded_state
from distrun.strategies.sharding.compile import compile_units
from distrun.strategies.sharding.state import load_full_model_state, on_cpu, on_meta, same_rng_as_rank0
from distrun.strategies.sharding.units import pick_units
from distrun.strategies.step.precision import PRECISION_DTYPES

__all__ = ["ModelParallelStrategy"]


def _quiet_torch() -> None:
    """What torch says on every step of a model-parallel job that is not news (this process only
    runs one job): the replicated modules' outputs leave as ``to_local()`` views
    (parallel/tensor.py), which FSDP2 warns about at the root in case a recipe writes into its
    output in place (the loss never does); and --clip-grad-norm's norm on the 4-D mesh reduces
    over two dimensions in two all-reduces of a few floats, which DTensor logs."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


class ModelParallelStrategy(ShardedStrategy):
    """``label``: the --strategy it runs under (mirrored, multi-worker, sharded): what the live
    view, the summary and the checkpoints call it."""

    def __init__(self, *args: Any, tp: int = 1, pp: int = 1, pp_schedule: str = "1f1b", microbatches: int = 0,
                 sequence_parallel: bool = False, loss_parallel: bool = False, label: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _quiet_torch()
        self.name = label
        self.shape: MeshShape = mesh_shape(self._replica.world_size, tp=tp, pp=pp, sharded=label == "sharded",
                                           shard_within=self._shard_within, hosts=self._hosts)
        self.parallel = ParallelMesh(self.shape, self.device.type)
        self.place = self.shape.place(self._replica.rank)
        self._replica_group = self.parallel.replica_group
        self._schedule_name = pp_schedule
        self._sequence_parallel = sequence_parallel
        self._loss_parallel = loss_parallel
        self._gradients_checked = not sequence_parallel  # --sequence-parallel: once, after the first backward
        self._microbatches = microbatches or 2 * pp
        #: The recipe's ``tp_plan(model)`` and ``pp_chain(model)``, when it defines them (the runtime sets them).
        self.tp_plan_from: Any = None
        self.pp_chain_from: Any = None
        self.pipeline: Pipeline | None = None
        self._parts: list[nn.Module] = []
        self._reference: tuple[nn.Module, Chain] | None = None  # rank 0, --pp: the whole model, until step 1
        self._full_order: list[str] = []  # the optimizer's parameter names over the whole model, in order
        self._whole_shapes: dict[str, list[int]] = {}  # the whole model's state_dict shapes, before it is split
        self._chain_checked = False

    @property
    def num_replicas(self) -> int:
        return self.shape.dp

    @property
    def replica_id(self) -> int:
        return self.place["dp"]

    @property
    def pipelined(self) -> bool:
        return self.shape.pp > 1

    def whole_shapes(self) -> dict[str, list[int]]:
        """The whole model's state_dict shapes, as every rank built it before the split: what a
        checkpoint of this model holds, whichever stages and slices this rank keeps."""
        return dict(self._whole_shapes)

    # -- building ---------------------------------------------------------------

    def _wrap(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        # Rank 0's values for everyone: the state_dict and every buffer (non-persistent ones too: a
        # causal mask, RoPE's tables), taken before its model goes to the meta device.
        whole = _values(model)  # rank 0's real tensors; the others' on the meta device, for their shapes
        self._whole_shapes = {key: list(value.shape) for key, value in model.state_dict().items()}
        if self.is_chief:
            whole = on_cpu(whole)
        names = parameter_names(model)
        if optimizer is not None:
            self._full_order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        plan = (resolve_plan(model, self.tp_plan_from, self.shape.tp, can_check=not self.pipelined)
                if self.shape.tp > 1 else None)
        check = PlanCheck(model if self.is_chief else None, self.name) if plan is not None and plan.checked else None
        parts = self._stages(model)
        said = [f"mesh {self.shape.describe()}"]
        for index, (stage, part) in enumerate(parts):
            if plan is not None:
                apply_tensor_parallel(part, _within(plan, part), self.parallel.tp,
                                      sequence_parallel=self._sequence_parallel, loss_parallel=self._loss_parallel)
                if index == 0:
                    said.append(plan.description + (", sequence parallel" if self._sequence_parallel else "")
                                + (", loss parallel" if self._loss_parallel else ""))
            units = pick_units(part, self.units_from)
            if index == 0:
                said.append(f"FSDP2 units{' of each stage' if self.pipelined else ''}: {units.description}")
            if self._step.settings.compile:
                compile_units(units.modules, self._step.settings.compile_mode)
            apply_fsdp(part, units.modules, self.parallel.data_parallel,
                       param_dtype=PRECISION_DTYPES.get(self.precision),
                       reshard_after_forward=self._reshard and not self.pipelined, offload=self._offload)
            part.to_empty(device=torch.device("cpu") if self._offload else self.device)
        if self.is_chief:
            print(f"[{self.name}] " + "; ".join(said), flush=True)
        self._parts = [part for _, part in parts]
        self._broadcast_pieces(whole)
        del whole
        same_rng_as_rank0(self._collective_device)
        if not self.pipelined:
            if check is not None:
                check.install(self._parts[0])
            rebuilt = rebuild_optimizer(optimizer, self._parts[0], names) if optimizer is not None else None
            if rebuilt is not None:
                self._wait_for_copies(rebuilt)
            return self._parts[0], rebuilt
        schedule, pp = self._schedule_name, self.shape.pp
        self.pipeline = Pipeline(parts, stages=pp * stages_per_rank(schedule), device=self.device,
                                 group=self.parallel.pipeline_group, schedule=schedule,
                                 microbatches=self._microbatches, rank_of=lambda stage: rank_of_stage(schedule, stage, pp))
        container = PipelineParts(self._parts)
        if optimizer is None:
            return container, None
        hooked = any(getattr(optimizer, table, None) for table in ("_optimizer_step_pre_hooks",
                                                                   "_optimizer_step_post_hooks"))
        if len(self._parts) > 1 and hooked:
            # One optimizer per stage: the recipe's hook would run once per stage, each step.
            raise RecipeError(f"--pp-schedule {schedule} puts {len(self._parts)} stages on a rank, each stepped by "
                              "its own optimizer, so the optimizer's step hook would run that many times a step; "
                              "use a schedule with one stage per rank (1f1b, gpipe), or scheduler(optimizer)")
        optimizers = [rebuild_optimizer(optimizer, part, names, part=True) for part in self._parts]
        for stage_optimizer in optimizers:
            self._wait_for_copies(stage_optimizer)
        return container, PipelineOptimizer(optimizers, clip=self._step.settings.clip_grad_norm,
                                             group=self.parallel.pipeline_group)

    def _stages(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """(stage index, module) for each stage this rank holds: the whole model without --pp."""
        if not self.pipelined:
            if not on_meta(model):  # rank 0's copy: its values are in ``initial``, the pieces come from there
                model.to(torch.device("meta"))
            return [(0, model)]
        chain = chain_of(model, self.pp_chain_from)
        per_rank = stages_per_rank(self._schedule_name)
        cut = cut_chain(chain, self.shape.pp * per_rank)
        if self.is_chief:
            self._reference = (model, chain)  # checked against the chain on the first batch
            print(f"[{self.name}] pipeline: {cut.stages} stages over {self.shape.pp} ranks ({self._schedule_name}, "
                  f"{self._microbatches} microbatches), chain from {chain.source}: {cut.describe(chain)}", flush=True)
        base = meta_copy(model) if not on_meta(model) else model
        mine = stages_of_rank(self._schedule_name, self.place["pp"], self.shape.pp)
        return [(stage, keep_stages(meta_copy(base) if per_rank > 1 else base, chain, cut.items(stage)))
                for stage in mine]

    def _broadcast_pieces(self, whole: dict[str, torch.Tensor]) -> None:
        """Rank 0's initial values (``whole``: rank 0's tensors, the others' meta ones of the same
        names and shapes) into every rank's pieces, tensor by tensor in one order: each rank keeps
        what its stages hold (its slice of it, for a DTensor)."""
        mine: dict[str, torch.Tensor] = {}
        for part in self._parts:
            mine.update(_values(part))
        with torch.no_grad():
            for key, value in whole.items():
                tensor = (value.to(self._collective_device) if self.is_chief
                          else torch.empty(value.shape, dtype=value.dtype, device=self._collective_device))
                dist.broadcast(tensor, src=0)
                target = mine.get(key)
                if target is None:
                    continue
                if isinstance(target, DTensor):
                    piece = distribute_tensor(tensor.to(target.device), target.device_mesh, target.placements,
                                              src_data_rank=None)
                    target.to_local().copy_(piece.to_local())
                else:
                    target.copy_(tensor)

    # -- stepping ---------------------------------------------------------------

    def distribute_dataset(self, dataset: Any, global_batch_size: int, **kwargs: Any) -> Any:
        distributed = super().distribute_dataset(dataset, global_batch_size, **kwargs)
        if self.pipeline is not None:
            rows = global_batch_size // self.num_replicas // self._step.settings.accumulate  # one micro-batch's
            if rows % self._microbatches:
                batch = "micro-batch" if self._step.settings.accumulate > 1 else "batch"
                raise ConfigError(f"--microbatches {self._microbatches}: a replica's {batch} of {rows} does not split "
                                  "into equal microbatches")
            self.pipeline.set_batch_rows(rows)
        return distributed

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                         forward: Callable[[nn.Module, Any], Any] | None = None,
                         check: Callable[[Any], None] = lambda loss: None) -> torch.Tensor:
        if self.pipeline is not None:
            self._check_chain(batch)
        loss = super().forward_backward(model, batch, loss_fn, forward=forward, check=check)
        if not self._gradients_checked:
            self._check_sequence_gradients()
        return loss

    def _forward_backward_one(self, model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                              forward: Callable[[nn.Module, Any], Any] | None, check: Callable[[Any], None],
                              weight: float) -> torch.Tensor:
        """A (micro-)batch: through the pipeline's schedule under --pp, else the model's forward
        (under --loss-parallel, the loss on each rank's slice of the logits)."""
        if self.pipeline is not None:
            return self.pipeline.train_step(batch, loss_fn, weight, check)
        if not self._loss_parallel:
            return super()._forward_backward_one(model, batch, loss_fn, forward, check, weight)
        with loss_parallel():
            loss = super()._forward_backward_one(model, batch, loss_fn, forward, check, weight)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def _check_sequence_gradients(self) -> None:
        """--sequence-parallel, after the first backward: a module the plan left out saw a slice of
        the sequence (``check_sequence_gradients``); every rank learns it, and all stop together."""
        self._gradients_checked = True
        named = [(name, param) for part in self._parts for name, param in part.named_parameters()]
        found = check_sequence_gradients(named, self.parallel.tp.get_group())
        flag = torch.tensor([1.0 if found else 0.0], device=self._collective_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if float(flag) > 0:
            module = found.rpartition(".")[0] if found else "a module"
            raise RecipeError(f"--sequence-parallel: {module or found} took a slice of the sequence but is not in "
                              "tp_plan, so its gradient is each rank's slice's; mark it \"sequence\" (a norm, dropout: "
                              "anything per position) or split it (docs/strategies.md#sequence-parallel)")

    def _check_chain(self, batch: Any) -> None:
        """Before step 1, on rank 0's whole model and the first batch: does the chain compose to the
        forward? Every rank learns the verdict (a broadcast), so all stop together."""
        if self._chain_checked:
            return
        self._chain_checked = True
        problem = None
        if self._reference is not None:
            model, chain = self._reference
            problem = check_chain(model, chain, batch[0].to("cpu") if isinstance(batch, (tuple, list)) else batch)
            self._reference = None  # rank 0 holds the whole model no longer
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise RecipeError(str(verdict[0]))

    def eval_outputs(self, model: nn.Module, forward: Callable[[nn.Module, Any], Any], batch: Any) -> Any:
        if self.pipeline is None:
            outputs = super().eval_outputs(model, forward, batch)
            return outputs.full_tensor() if isinstance(outputs, DTensor) else outputs  # --loss-parallel's logits
        return self.pipeline.forward(batch[0] if isinstance(batch, (tuple, list)) else batch)

    @property
    def updates_metrics(self) -> bool:
        """One rank per replica updates evaluation metrics (the last stage's, tensor-parallel rank
        0): every rank syncs them over all ranks, so sums and counts come out once per sample."""
        return self.place["tp"] == 0 and (self.pipeline is None or self.pipeline.last)

    def _on_batch(self, samples: int, weight: float) -> None:
        """Every rank of a replica reads its batch: each reports its share, so the job counts it once."""
        super()._on_batch(samples / self.shape.per_replica, weight)  # type: ignore[arg-type]

    def _stepping_optimizer(self, optimizer: Any) -> torch.optim.Optimizer | None:
        """Under --pp the PipelineOptimizer clips over every stage itself."""
        return None if self.pipeline is not None else super()._stepping_optimizer(optimizer)

    def lr_optimizers(self) -> list[torch.optim.Optimizer]:
        """Under --pp, one optimizer per stage this rank holds, stepped together."""
        if isinstance(self._wrapped_optimizer, PipelineOptimizer):
            return list(self._wrapped_optimizer.optimizers)
        return super().lr_optimizers()

    # -- checkpoints: each stage's pieces under the whole model's names ---------------

    def _checkpoint_meta(self) -> dict[str, Any]:
        return {**super()._checkpoint_meta(), "mesh": {"dp": self.shape.dp, "tp": self.shape.tp, "pp": self.shape.pp}}

    def _part_optimizers(self) -> list[Any]:
        optimizer = self._torch_optimizer
        if isinstance(optimizer, PipelineOptimizer):
            return optimizer.optimizers
        return [optimizer] * len(self._parts)

    def _buffer_keys(self) -> set[str]:
        """Each stage's buffers, under the keys its part's state gives them."""
        return {MODEL_PREFIX + name for part in self._parts for name, _ in part.named_buffers()}

    def _sharded_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if not self.pipelined:
            return super()._sharded_state()
        tensors: dict[str, Any] = {}
        rests = []
        for part, optimizer in zip(self._parts, self._part_optimizers()):
            part_tensors, rest = sharded_state(part, optimizer)
            tensors.update(part_tensors)
            rests.append(rest)
        # The chief writes the sidecar: it needs every stage's groups and scalars, in stage order.
        every: list[Any] = [None] * dist.get_world_size(self.parallel.pipeline_group)
        dist.all_gather_object(every, rests, group=self.parallel.pipeline_group)
        by_stage = sorted(((stage, rest) for rank, mine in enumerate(every)
                           for stage, rest in zip(stages_of_rank(self._schedule_name, rank, self.shape.pp), mine)),
                          key=lambda pair: pair[0])
        return tensors, merge_rest([rest for _, rest in by_stage])

    def _load_sharded(self, path: Path, data: dict[str, Any]) -> None:
        if not self.pipelined:
            return super()._load_sharded(path, data)
        for part, optimizer in zip(self._parts, self._part_optimizers()):
            own = {name for name, _ in part.named_parameters()}
            keys = set(part.state_dict())
            sidecar = {**data, "model": {k: v for k, v in (data.get("model") or {}).items() if k in keys},
                       "optimizer": restricted(data.get("optimizer"), own)}
            load_sharded(path, part, optimizer, sidecar)

    def _load_model_state(self, state: dict[str, Any]) -> None:
        if not self.pipelined:
            return super()._load_model_state(state)
        for part in self._parts:
            keys = set(part.state_dict())
            load_full_model_state(part, {k: v for k, v in state.items() if k in keys})

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        if not self.pipelined or not state:
            return super()._load_optimizer_state(state)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        named = layout.named(state, self._full_order)  # a plain checkpoint's: indexed over the whole model
        for part, optimizer in zip(self._parts, self._part_optimizers()):
            own = {name for name, _ in part.named_parameters()}
            set_optimizer_state_dict(part, optimizer, restricted(named, own),
                                     options=StateDictOptions(full_state_dict=True))


def _within(plan: TensorPlan, part: nn.Module) -> TensorPlan:
    """The plan's entries for the modules a pipeline stage holds."""
    present = {name for name, _ in part.named_modules()}
    return TensorPlan({name: style for name, style in plan.styles.items() if name in present}, plan.description)


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict's tensors (kept as they are: a DTensor stays one) and every buffer by name,
    non-persistent ones too."""
    values = dict(model.state_dict(keep_vars=True))
    for name, buffer in model.named_buffers():
        values.setdefault(name, buffer)
    return {name: value for name, value in values.items() if isinstance(value, torch.Tensor)}
