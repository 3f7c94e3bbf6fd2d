"""The Strategy API shared by every strategy, by custom loops and by distrun's fit loop.

A recipe never names a strategy: it receives one. Each training process holds
one replica; ``num_replicas``/``replica_id`` say which. Under every strategy
the same calls mean the same thing, so switching strategy is a flag.

``run(fn, *args)`` is one training step: it calls ``fn`` on this replica, counts
the step, and reports it (the value ``fn`` returns, when a scalar, is shown as the
loss). Gradients are synchronised by the model or optimizer that ``prepare``
returns, never by the recipe.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from distrun.errors import ConfigError
from distrun.strategies.checkpoint.replica import CheckpointReplica
from distrun.strategies.collectives import REDUCE_OPS, ReplicaCollectives
from distrun.strategies.step.compile import CompileStats, plain_module
from distrun.strategies.data.plan import DistributedDataset
from distrun.strategies.elastic.replica import Elastic, ElasticReplica, MembershipSwitch
from distrun.strategies.parallel.activation import checkpoint_units
from distrun.strategies.sharding.units import pick_units
from distrun.strategies.step.clipping import clip_before_step
from distrun.strategies.step.precision import all_reduce_max
from distrun.strategies.step.accumulation import gradient_sync, split_batch
from distrun.strategies.step.settings import ReplicaStep, StepSettings
from distrun.strategies.step.sync_clock import SyncClock

__all__ = ["Strategy", "Reporter", "ReplicaInfo", "StepSettings", "LoopOptions", "REDUCE_OPS"]


class Reporter(Protocol):
    """Where a strategy sends progress; the runtime implements it with events."""

    #: What the replica does outside a step ("saving a checkpoint"): a failure then is named by it.
    during: str | None

    def step_started(self, step: int) -> None: ...

    def step(self, step: int, epoch: int, loss: Any, samples: int, sync_wait_s: float | None = None) -> None: ...

    def worker_progress(self, pushes: int, staleness: int) -> None: ...

    def bytes_moved(self, embedding_bytes_per_step: float, dense_grad_bytes_per_step: float) -> None: ...

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def checkpoint(self, step: int, path: str, blocked_ms: float) -> None: ...

    def compiled(self, stats: CompileStats) -> None: ...

    def allreduce_chosen(self, choice: Any) -> None: ...

    def membership(self, change: Any, *, report: bool) -> None: ...

    def synced(self, *, step: int, outer_step: int, fragment: int, fragments: int, bytes_sent: int, elements: int,
               seconds: float, blocked_s: float, dtype: str) -> None: ...


@dataclass(frozen=True)
class ReplicaInfo:
    """This process's place in the job (from the launcher's environment)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    seed: int = 0
    node_rank: int = 0  # the host this replica runs on (hierarchical all-reduce groups by it)


@dataclass(frozen=True)
class LoopOptions:
    """The job's options a loop acts on (``strategy.options``): what the fit loop does with them, a
    custom loop may do too, so ``--steps``, ``--eval-every`` or ``--resume`` mean the same for it.
    None where the job did not say (``steps``: neither ``--steps`` nor the recipe's defaults)."""

    steps: int | None = None
    epochs: int | None = None
    global_batch_size: int | None = None
    seed: int = 0
    eval_every: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    keep: int = 3
    resume: bool = False
    clip_grad_norm: float | None = None
    accumulate: int = 1
    args: tuple[str, ...] = ()


def _state_follows_parameters(optimizer: Any) -> None:
    """State an optimizer made when it was built (Adagrad's ``sum``) was made where the parameters
    were then, on the CPU, before the strategy moved the model to its device: it moves with them.
    Scalars stay (Adam's ``step`` lives on the CPU on purpose)."""
    state = getattr(optimizer, "state", None)
    if not isinstance(state, Mapping):
        return
    for param, entries in state.items():
        if not isinstance(param, torch.Tensor) or not isinstance(entries, dict):
            continue
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.device != param.device:
                entries[key] = value.to(param.device)


class Strategy(ReplicaCollectives, CheckpointReplica, ElasticReplica, ABC):
    """Base class; subclasses decide where parameters live and how gradients meet."""

    name = "strategy"
    #: The job's options (the runtime sets them before the recipe runs).
    options: LoopOptions = LoopOptions()

    def __init__(self, replica: ReplicaInfo, reporter: Reporter, *, step: StepSettings = StepSettings(),
                 elastic: Elastic | None = None) -> None:
        """``elastic``: this replica's membership under ``--elastic`` (its first round joined;
        ``replica`` is its place in that round): see :meth:`recover`."""
        self._replica = replica
        self._elastic = elastic
        self._committed_position = (0, 0)  # the data position after the last committed step (elastic heals it)
        self._healed_position: tuple[int, int] | None = None
        self._recoveries_in_a_row = 0  # elastic: recoveries since the last committed step
        self._reporter = reporter
        self._step = ReplicaStep(step, lambda: self.device,
                                 all_reduce_max(lambda: self._distributed, lambda: self._collective_device),
                                 self._skipped)
        self._model: nn.Module | None = None
        self._optimizer: Any = None
        self.step = 0
        self.epoch = 0
        self.restored_from: Path | None = None  # restore(): the checkpoint it read
        self._batch_samples = 0
        self._reported_samples: int | None = None  # report_samples() in the current step
        self._batch_weight = 1.0
        self._global_batch_size: int | None = None
        self._dataset: DistributedDataset | None = None
        self._clock = SyncClock()  # each step's wait for peers: compute time = step time less it
        #: The recipe's ``shard_units(model)``, when it defines one (the runtime sets it): the
        #: blocks sharded shards one by one and activation checkpointing recomputes.
        self.units_from: Callable[[nn.Module], Any] | None = None
        #: The group ``reduce`` and ``gather`` run over: one rank per replica's share (None: all
        #: ranks; model parallel's replicas span several ranks, each holding the same values).
        self._replica_group: Any = None

    # -- identity -------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return self._replica.world_size

    @property
    def replica_id(self) -> int:
        return self._replica.rank

    @property
    def is_chief(self) -> bool:
        return self._replica.rank == 0

    @property
    def device(self) -> torch.device:
        return self._replica.device

    # -- what the training loop asks of a strategy (parameter-server differs) ---

    @property
    def updates_per_batch(self) -> int:
        """Steps (applied updates) per global batch of data: 1 for synchronous strategies."""
        return 1

    @property
    def evaluates(self) -> bool:
        """Whether this replica takes part in evaluation."""
        return True

    @property
    def eval_shard(self) -> tuple[int, int]:
        """(index, count): which share of the eval set this replica evaluates."""
        return (self.replica_id, self.num_replicas)

    def set_step_budget(self, total_steps: int | None) -> None:
        """The loop's step count, for strategies that enforce it where updates are applied."""

    # -- building -------------------------------------------------------------

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """Create the model and optimizer inside this; ``prepare`` moves them to the device.

        Parameters are built on the CPU, whatever the device: initialisation draws from
        the CPU generator the job's seed set, so the same seed gives the same initial
        parameters on CPU and on CUDA, under every strategy (building on the GPU would draw
        from CUDA's generator, a different stream).
        """
        return torch.device("cpu")

    #: fp16: the optimizer's ``step`` unscales ``param.grad`` and skips on overflow (see ReplicaStep.finish).
    _unscale_in_step = True
    #: --compile: the strategy compiles its own parts in ``_wrap`` (sharded: each block), so the
    #: step neither wraps the model for compilation nor compiles it whole.
    _compiles_units = False

    @abstractmethod
    def _wrap(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        """Return the (model, optimizer) pair the training step must use."""

    def prepare(self, model: nn.Module, optimizer: Any = None) -> tuple[nn.Module, Any]:
        """The strategy's wrapping, then the step's: compile (after DDP, in its order) and fp16 scaling."""
        if self._elastic is not None and self._elastic.round is None:  # a joiner, its model built: join now
            round_ = self._elastic.first_round()
            self._replica = dataclasses.replace(self._replica, rank=round_.rank, world_size=round_.world_size)
        mode = self._step.settings.activation_checkpointing
        if mode != "none":  # before the strategy wraps: FSDP's and DDP's hooks stay outside the recomputation
            units = pick_units(model, self.units_from)
            checkpoint_units(units.modules or (model,), mode)
            if self.is_chief:
                print(f"[{self.name}] activation checkpointing ({mode}): {units.description}", flush=True)
        model, optimizer = self._wrap(model if self._compiles_units else self._step.root(model), optimizer)
        _state_follows_parameters(optimizer)
        self._wrapped_optimizer = optimizer
        stepping = self._stepping_optimizer(optimizer)
        if self._step.settings.clip_grad_norm and stepping is not None:
            self._clip_before_step(stepping, self._step.settings.clip_grad_norm)
        model, optimizer = self._step.finish(model, optimizer, unscale_in_step=self._unscale_in_step,
                                             compile_whole=not self._compiles_units)
        self._model, self._optimizer = model, optimizer
        self._clock.watch(model, stepping, self.device)
        if self.joined and self._healed_position is None:
            self._heal_joiner()  # the members already training rebuilt their DDP with us and heal us now
        return model, optimizer

    def _clip_before_step(self, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
        """``--clip-grad-norm``: the global norm of ``optimizer``'s gradients, clipped before each step
        (the hybrid's norm takes in its tables' rows too)."""
        clip_before_step(optimizer, max_norm)

    def _stepping_optimizer(self, optimizer: Any) -> torch.optim.Optimizer | None:
        """The torch optimizer that really steps this replica's parameters (what --clip-grad-norm
        hooks), in what ``_wrap`` returned; None where this replica steps none."""
        return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None

    #: What ``_wrap`` returned for the optimizer (before fp16's wrapper): see :meth:`lr_optimizers`.
    _wrapped_optimizer: Any = None

    def lr_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose groups' lr this replica's updates use, after ``prepare``:
        what a recipe's ``scheduler`` must be built on (sharded, --tp and --pp rebuild the
        recipe's optimizer; --pp has one per stage). Empty where this replica steps none."""
        optimizer = self._wrapped_optimizer
        return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else []

    def unwrap(self, model: nn.Module | None = None) -> nn.Module:
        """The plain module under any wrapper, torch.compile's and DDP's (what checkpoints store)."""
        target = model if model is not None else self._model
        if target is None:
            raise ConfigError("strategy.unwrap: call prepare(model, optimizer) first")
        return plain_module(target)

    def compute_model(self) -> nn.Module:
        """The plain module this replica computes with, on ``self.device``: what evaluation runs.

        The same module as :meth:`unwrap` except under central-storage, whose unwrapped
        model is the central copy in host memory (what checkpoints store).
        """
        return self.unwrap()

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[nn.Module]:
        """The module evaluation runs (``compute_model``), around the whole evaluation: a
        strategy may restore its training layout after (sharded frees gathered blocks)."""
        yield self.compute_model()

    def eval_forwards_to_match(self, forwards: int) -> int:
        """Extra forwards this replica must run after its ``forwards`` evaluation batches, so
        that every replica runs as many (0 unless the strategy's forward is a collective)."""
        return 0

    def _skipped(self, scale: float) -> None:
        """fp16: this step's update was skipped (inf/NaN gradients on some replica); said as a log."""
        self._reporter.log(self.step + 1, {"fp16_skipped_step": 1.0, "loss_scale": scale})

    @property
    def precision(self) -> str:
        return self._step.settings.precision

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast to the job's ``--precision`` (a no-op for fp32); ``run`` enters it for you."""
        return self._step.autocast()

    # -- data -----------------------------------------------------------------

    def distribute_dataset(
        self,
        dataset: Any,
        global_batch_size: int,
        *,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> DistributedDataset:
        if global_batch_size % self.num_replicas and self._elastic is None:  # elastic: uneven shares, weighted
            raise ConfigError(
                f"global batch size {global_batch_size} is not divisible by {self.num_replicas} replicas; "
                f"choose a multiple of {self.num_replicas}"
            )
        self._global_batch_size = global_batch_size
        self._dataset = DistributedDataset(
            dataset,
            global_batch_size,
            num_replicas=self.num_replicas,
            replica_id=self.replica_id,
            seed=self._replica.seed,
            on_batch=self._on_batch,
            any_exhausted=self._any_true,
            shuffle=shuffle,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
        if self._healed_position is not None:  # a joiner: where the members it joined had got to
            self._dataset.seek(*self._healed_position)
        self._committed_position = self._dataset.position
        return self._dataset

    def _on_batch(self, samples: int, weight: float) -> None:
        self._batch_samples, self._batch_weight = samples, weight
        if self._dataset is not None:
            self.epoch = self._dataset.epoch

    def report_samples(self, samples: int) -> None:
        """Count ``samples`` more samples in this replica's current step (call it in the step, or
        before ``run``): the live view's samples/s and the summary's then count what the step ran.
        Without it a step counts the rows of the last batch ``distribute_dataset`` gave, which is
        wrong for a loop that runs several batches a step (its own accumulation)."""
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ConfigError(f"strategy.report_samples: a whole number of samples >= 0. Received: {samples!r}")
        self._reported_samples = (self._reported_samples or 0) + samples

    @property
    def batch_weight(self) -> float:
        """Multiply this replica's mean loss by this before backward.

        It is 1.0 for every full global batch; for the last, uneven one it makes
        the averaged gradient equal the one-device gradient exactly.
        """
        return self._batch_weight

    def compute_average_loss(self, per_example_loss: torch.Tensor) -> torch.Tensor:
        """Mean loss of this replica's examples, weighted for the global batch (TF's helper)."""
        n = per_example_loss.shape[0] if per_example_loss.dim() else 1
        mean = per_example_loss.sum() / max(n, 1)
        return mean * self._batch_weight if n else per_example_loss.sum() * 0.0

    # -- stepping and collectives ---------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._elastic is not None and self._elastic.switch_due(self.step, self._switch_boundary()):
            raise MembershipSwitch(f"a member joins after step {self.step}")
        self._reporter.step_started(self.step + 1)
        self._clock.begin()
        try:
            with self.autocast():
                result = fn(*args, **kwargs)
        except BaseException:
            self._clock.discard()  # its waits (up to the failure) are no later step's
            self._reported_samples = None  # nor its samples (--elastic redoes it)
            raise
        self.step += 1
        if self._elastic is not None:
            self._recoveries_in_a_row = 0  # progress: the cap on recoveries counts from here
            self._committed()
        self._after_step()
        self._report_step(result)
        return result

    def _after_step(self) -> None:
        """Hook: the step is counted and committed, not yet reported (DiLoCo syncs here when one is due)."""

    def _switch_boundary(self) -> int | None:
        """``--elastic``: the step after which members switch to a joiner's round, if this one proposes it
        (None: the next step, where every synchronous step meets every member)."""
        return None

    def settle(self) -> None:
        """Bring the replicas to one set of weights before an evaluation, a checkpoint or the end of
        the run. Synchronous strategies always are; DiLoCo syncs what has not just synced."""

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                         forward: Callable[[nn.Module, Any], Any] | None = None,
                         check: Callable[[Any], None] = lambda loss: None) -> torch.Tensor:
        """One replica batch's forward, ``loss_fn(outputs, batch)`` and backward (the gradients
        weighted by ``batch_weight``); the loss, detached. ``forward`` (default: the model on
        ``batch[0]``) gives the outputs; ``check`` sees each loss before its backward.

        A custom loop's step calls it too: under ``--pp`` the pipeline's schedule does it,
        microbatch by microbatch (a rank holds stages, which cannot be called as one model),
        and the same loop runs unchanged under every other layout."""
        parts = self._step.settings.accumulate
        if parts == 1:
            return self._forward_backward_one(model, batch, loss_fn, forward, check, self.batch_weight)
        # --accumulate: each micro-batch weighted by its share of the rows; only the last backward syncs.
        losses = []
        for index, (chunk, share) in enumerate(split_batch(batch, parts)):
            with gradient_sync(model, index == parts - 1):
                loss = self._forward_backward_one(model, chunk, loss_fn, forward, check, self.batch_weight * share)
            losses.append(loss.float() * share)
        return torch.stack(losses).sum()  # the replica batch's mean loss

    def _forward_backward_one(self, model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                              forward: Callable[[nn.Module, Any], Any] | None, check: Callable[[Any], None],
                              weight: float) -> torch.Tensor:
        """One (micro-)batch's forward, loss and backward, its gradients scaled by ``weight``."""
        loss = loss_fn((forward or _inputs_first)(model, batch), batch)
        check(loss)
        (loss * weight if weight != 1.0 else loss).backward()
        return loss.detach()

    @property
    def updates_metrics(self) -> bool:
        """Whether this rank's evaluation outputs go into the metrics (every replica's rank does;
        a model-parallel replica's other ranks hold the same outputs, or none)."""
        return True

    def eval_outputs(self, model: nn.Module, forward: Callable[[nn.Module, Any], Any], batch: Any) -> Any:
        """The model's outputs for an evaluation batch; None on a rank that has none (a pipeline
        stage before the last)."""
        return forward(model, batch)

    def _report_step(self, result: Any) -> None:
        self._finish_checkpoint(block=False)
        loss = result if isinstance(result, (torch.Tensor, float, int)) else None
        timed_s = self._clock.waited_s() if self._clock.measures else None  # read every step: it ends the step
        samples = self._batch_samples if self._reported_samples is None else self._reported_samples
        self._reported_samples = None
        self._reporter.step(self.step, self.epoch, loss, samples, sync_wait_s=self._sync_wait_s(timed_s))
        stats = self._step.compile_progress()
        if stats is not None:
            self._reporter.compiled(stats)

    def _sync_wait_s(self, timed_s: float | None) -> float | None:
        """How long this step waited for the other replicas (its compute time is the rest), given
        what the clock timed; None where that cannot be told apart from compute
        (docs/debugging.md#slow-ranks)."""
        return timed_s

    def log(self, **scalars: float) -> None:
        self._reporter.log(self.step, {k: float(v) for k, v in scalars.items()})

    def close(self) -> None:
        """Leave the process group together: nobody tears down while a peer still talks."""
        self._finish_checkpoint()
        if self._elastic is not None:
            # Before the barrier, while every member is here: after it, the chief's host may end, and
            # the store with it, while a member on another host still writes (seen as a joiner's
            # "failed at step 301: DistNetworkError: Connection reset by peer" on a 300-step job).
            self._elastic.mark_finished()  # a joiner still waiting for a round leaves
        if self._distributed:
            dist.barrier()
            dist.destroy_process_group()
        if self._elastic is not None:
            self._elastic.close()

    def __iter__(self) -> Iterator[Any]:  # pragma: no cover - guard against a common mistake
        raise TypeError("a Strategy is not iterable; iterate strategy.distribute_dataset(...)")


def zero_grads(params: list[nn.Parameter], set_to_none: bool) -> None:
    """``optimizer.zero_grad`` for optimizers that stand in for the recipe's (they own no grads)."""
    for p in params:
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()


def _inputs_first(model: nn.Module, batch: Any) -> Any:
    """The default forward of ``forward_backward``: the model on the batch's first item."""
    return model(batch[0] if isinstance(batch, (tuple, list)) else batch)
