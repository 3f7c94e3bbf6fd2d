"""distrun's own training loop for fit-style recipes (Keras compile/fit, Estimator).

The loop is written once against the Strategy API, so it is the same loop under
every strategy: ``prepare`` decides how gradients meet, ``distribute_dataset``
decides which samples each replica reads, ``batch_weight`` keeps the last
uneven batch exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from distrun.config import JobSpec
from distrun.errors import RecipeError
from distrun.runtime._callbacks import build_callbacks
from distrun.runtime._flops import peak_flops
from distrun.runtime._move import to_device
from distrun.runtime._nonfinite import NonFiniteGuard
from distrun.runtime._preempt import Preempted, PreemptWatch
from distrun.runtime._reporter import EventReporter, to_float
from distrun.runtime._schedule import build_schedule
from distrun.strategies import InputContext, MembershipSwitch, Strategy
from distrun.strategies.elastic.replica import one_line


@dataclass(frozen=True)
class FitResult:
    steps: int
    final_loss: float | None
    eval_metrics: dict[str, float]
    #: A callback ended the run early: its class and what it said ("EarlyStopping: eval_loss did not ...").
    stopped_by: str | None = None


def _default_forward(model: torch.nn.Module, batch: Any) -> Any:
    return model(batch[0])


def _report_workload(recipe: ModuleType, model: torch.nn.Module, strategy: Strategy, spec: JobSpec,
                     reporter: EventReporter) -> None:
    """``tokens_per_sample`` (and ``flops_per_token(model)``), when the recipe defines them: the
    live view and the summary then show tokens/s, and MFU on a GPU distrun knows."""
    tokens = getattr(recipe, "tokens_per_sample", None)
    if tokens is None:
        return
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise RecipeError(f"{spec.recipe}: tokens_per_sample must be a positive int. Received: {tokens!r}")
    count = getattr(recipe, "flops_per_token", None)
    flops = float(count(model)) if callable(count) else None
    # Every rank's device counts: a replica of --tp x --pp ranks computes on that many.
    reporter.workload(tokens, flops, peak_flops(strategy.device, spec.precision.name),
                      strategy.num_replicas * spec.parallel.ranks_per_replica)


def _not_one_number(loss_fn: Any, loss: Any) -> RecipeError:
    """``loss()`` returned a tensor with a shape (``reduction='none'``) or no tensor: named at the recipe's
    ``loss`` (backward would say only "grad can be implicitly created only for scalar outputs")."""
    got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
    error = RecipeError(f"loss() returned {got}; it must return one number for backward: "
                        "reduce it, e.g. .mean(), or reduction='mean' (the default) in torch.nn.functional")
    code = getattr(loss_fn, "__code__", None)
    if code is not None:
        error.recipe_location = (code.co_filename, code.co_firstlineno)  # type: ignore[attr-defined]
    return error


def fit(recipe: ModuleType, strategy: Strategy, spec: JobSpec, reporter: EventReporter, emit_eval: Any) -> FitResult:
    global_batch_size = spec.training.global_batch_size
    if global_batch_size is None:  # the CLI fills it from flags or recipe defaults
        global_batch_size = 32 * strategy.num_replicas
    torch.manual_seed(spec.training.seed)  # identical initial parameters on every replica
    reporter.during = "building the model"  # a failure here is not "at step 1"
    with strategy.scope():
        model = recipe.model()
        reporter.during = "building the optimizer"
        optimizer = recipe_optimizer = recipe.optimizer(model.parameters())
    if strategy.is_chief:
        _report_workload(recipe, model, strategy, spec, reporter)
    reporter.during = "preparing the model for the strategy"
    model, optimizer = strategy.prepare(model, optimizer)
    reporter.during = "building the learning-rate scheduler"
    # After prepare: on the optimizers the strategy steps (rebuilt on shards, one per --pp stage).
    schedule = strategy.lr_schedule = build_schedule(recipe, strategy, spec, recipe_optimizer)
    if schedule is not None and strategy.joined:  # a joiner, healed by a peer: the schedule its source held
        schedule.load_state_dict(strategy.healed_lr_schedule, strategy.step)
    reporter.during = "building the callbacks"
    callbacks = build_callbacks(recipe, strategy, spec, reporter)  # after prepare: a callback may keep the weights
    if callbacks is not None and spec.strategy.elastic:  # a heal carries their state (EarlyStopping's count)
        strategy.callbacks_state, strategy.load_callbacks_state = callbacks.checkpoint_state, callbacks.load_state
        if strategy.joined and strategy.healed_callbacks is not None:  # healed in prepare, before they existed
            callbacks.load_state(strategy.healed_callbacks)
    reporter.during = "loading the data"
    # After prepare: an elastic joiner learns its place in the job there.
    ctx = InputContext(strategy.num_replicas, strategy.replica_id, global_batch_size, spec.training.seed)
    forward = getattr(recipe, "forward", _default_forward)
    if spec.parallel.pp > 1 and forward is not _default_forward:
        raise RecipeError(f"{spec.recipe}: --pp runs the model as a chain of stages fed batch[0]; a recipe "
                          "forward(model, batch) cannot be split into them: drop it, or put its work in pp_chain")
    loss_fn = recipe.loss
    # On a GPU the batches come in page-locked memory, so to_device's non-blocking copy overlaps compute.
    workers = spec.training.data_workers
    train = strategy.distribute_dataset(recipe.train_data(ctx), global_batch_size, num_workers=workers,
                                        pin_memory=strategy.device.type == "cuda")
    if workers and train.plan is None:
        raise RecipeError(f"--data-workers {workers}: {spec.recipe}'s train_data is an iterable, which "
                          "distrun reads as given; give it a map-style Dataset, or set num_workers on its own DataLoader")
    if spec.checkpoint.dir:
        reporter.during = "checking --checkpoint-dir"
        strategy.check_checkpoint_dir(spec.checkpoint.dir)
    resume = spec.checkpoint.resume
    if spec.checkpoint.dir and not strategy.joined:  # a joiner was healed by a peer
        # --resume-if-any is decided per node (Slurm, Kubernetes): on storage a node's own, some would
        # restore and some not. Every rank resumes where any asked to, from the checkpoint they agree on.
        resume = strategy._any_true(resume)  # noqa: SLF001 - the strategy's own collective
    if resume and spec.checkpoint.dir and not strategy.joined:
        reporter.during = "restoring the checkpoint"
        restored = strategy.restore(spec.checkpoint.dir)
        if callbacks is not None:  # EarlyStopping's count goes on where it left (Lightning's choice)
            callbacks.load_state(restored.get("extra"))

    epochs = spec.training.epochs
    total_steps = spec.training.steps
    if total_steps is None:
        epochs = epochs or 1
        if train.plan is not None:
            total_steps = epochs * train.plan.batches_per_epoch * strategy.updates_per_batch
    reporter.total_steps = total_steps
    if strategy.is_chief and strategy.restored_from is not None:  # --resume: say from where, and if it is done
        past_end = total_steps is not None and strategy.step >= total_steps
        reporter.resumed(strategy.step, str(strategy.restored_from), past_end=past_end)
    strategy.set_step_budget(total_steps)

    reporter.during = "loading the evaluation data"
    eval_source = recipe.eval_data(ctx) if hasattr(recipe, "eval_data") else None
    make_metrics = getattr(recipe, "metrics", None)
    metrics = make_metrics() if make_metrics is not None else {}
    device = strategy.device

    guard = NonFiniteGuard(spec.training.on_nonfinite, strategy)
    preempt = PreemptWatch(spec.preemptible)
    # The lr each step used (read after optimizer.step: a step pre-hook may set it), for the step
    # events, --tensorboard and the trackers; None where this replica has no groups to read.
    groups = (schedule.schedulers[0].optimizer.param_groups if schedule is not None
              else getattr(optimizer, "param_groups", None))
    used_lr: list[Any] = [None]

    def read_lr() -> Any:
        """The first group's lr as it is: a tensor lr is copied, not read (no device sync per step;
        the reporter reads it only for the steps it sends)."""
        lr = groups[0]["lr"] if groups else None
        return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr

    reporter.learning_rate = lambda: used_lr[0] if used_lr[0] is not None else read_lr()

    def one_number(loss: Any) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:  # backward takes one number, any shape
            raise _not_one_number(loss_fn, loss)

    def train_step(batch: Any) -> torch.Tensor:
        batch = to_device(batch, device)
        optimizer.zero_grad(set_to_none=True)
        loss = strategy.forward_backward(model, batch, loss_fn, forward=forward, check=one_number)
        allowed = guard.update_allowed(loss)
        if allowed:
            optimizer.step()
        used_lr[0] = read_lr()
        if schedule is not None:  # once per applied update, after it (a skipped one does not move it)
            schedule.after_step(allowed)
        return loss

    last_eval: dict[str, float] = {}
    last_loss: torch.Tensor | None = None
    checkpoint_every = spec.checkpoint.every
    ckpt_dir = spec.checkpoint.dir
    last_saved = strategy.step if resume else -1
    # Steps may advance by more than one (asynchronous workers see every update), so a
    # checkpoint is due when the step crosses a multiple of checkpoint_every.
    last_mark = strategy.step // checkpoint_every if checkpoint_every else 0

    def save(wait: bool) -> None:
        """A checkpoint of this step, the callbacks' state in its ``extra`` (only with callbacks:
        parameter-server, which has none, keeps its own ``save``)."""
        extra = {} if callbacks is None else {"extra": callbacks.checkpoint_state()}
        strategy.save(ckpt_dir, keep=spec.checkpoint.keep, wait=wait, **extra)

    def finished() -> bool:
        if callbacks is not None and callbacks.stopped:  # the ranks agreed: a callback ended the run
            return True
        if total_steps is not None and strategy.step >= total_steps:
            return True
        # A step budget decides alone: an asynchronous worker's own epochs are not the job's.
        return total_steps is None and epochs is not None and train.position[0] >= epochs

    evaluated_at: int | None = None  # the step of the newest evaluation
    evaluating = eval_source is not None and strategy.evaluates
    eval_every = spec.training.eval_every
    eval_mark = strategy.step // eval_every if eval_every else 0

    def run_eval(epoch: int) -> dict[str, float]:
        nonlocal evaluated_at
        with reporter.outside_steps():  # not training: left out of samples/s and the step's time
            # Imported here: torchmetrics costs 1-3 s to import, and the first step should not wait for it.
            from distrun.runtime._metrics import evaluate

            result = evaluate(
                strategy,
                eval_source,
                forward=forward,
                loss_fn=loss_fn,
                metrics=metrics,
                per_replica_batch_size=ctx.per_replica_batch_size,
            )
            if strategy.is_chief:
                emit_eval(strategy.step, epoch, result)
            evaluated_at = strategy.step
            if schedule is not None:  # ReduceLROnPlateau: stepped with the monitored metric
                schedule.after_eval(result)
            if callbacks is not None:
                callbacks.eval_end(result)
        return result

    def end_of_run(epoch: int) -> None:
        """One set of weights (diloco: the last sync), then the run's evaluation unless this step had one."""
        nonlocal last_eval, eval_due, ended
        strategy.settle()
        if evaluating and evaluated_at != strategy.step:
            eval_due = epoch
            last_eval, eval_due = run_eval(epoch), None
        ended = True

    eval_due: int | None = None  # an epoch whose evaluation a change of membership interrupted
    ended = False  # the run's end was settled and evaluated
    if callbacks is not None:
        callbacks.total_steps = total_steps
        callbacks.train_begin()
        if not strategy.joined:  # its agreement is a collective the members already training passed long
            callbacks.agreed_stop()  # ago: a joiner's stop is agreed after its first step, with theirs
    reporter.during = None  # from here a failure is at a step
    while not ended:
        failed_at, switch, cause = None, False, ""
        try:
            if eval_due is not None:
                last_eval, eval_due = run_eval(eval_due), None
                continue
            if finished():  # the last step is done; a change of membership interrupted its end
                end_of_run(train.position[0])
                continue
            epoch = train.position[0]
            model.train()
            for batch in train:
                last_loss = strategy.run(train_step, batch)
                if callbacks is not None:
                    callbacks.step_end(last_loss, to_float(used_lr[0]))
                if ckpt_dir and checkpoint_every and strategy.step // checkpoint_every > last_mark:
                    # The run's last save with no evaluation after it to be written behind: written
                    # at once (``--async-checkpoint`` would only copy first; the job waits for it anyway).
                    save(wait=finished() and not evaluating)
                    last_saved, last_mark = strategy.step, strategy.step // checkpoint_every
                if finished():
                    break
                # --eval-every: due when the step crosses a multiple (asynchronous steps may skip one).
                if evaluating and eval_every and strategy.step // eval_every > eval_mark:
                    eval_mark, eval_due = strategy.step // eval_every, train.position[0]
                    last_eval, eval_due = run_eval(eval_due), None
                if preempt.agreed(strategy):  # the job will end: checkpoint this step, stop to be requeued
                    if ckpt_dir and last_saved != strategy.step:
                        save(wait=True)
                    strategy.wait_for_checkpoint()
                    strategy.barrier()  # so any rank's exit 75 means the checkpoint is published
                    raise Preempted(strategy.step, checkpoint=bool(ckpt_dir))
                if callbacks is not None and callbacks.agreed_stop():  # every rank, after this same step
                    break
            epoch_done = train.position[0] > epoch  # also when a step limit stopped on its last batch
            if finished():  # the run's end wherever it falls (a --steps run mid-epoch too)
                end_of_run(epoch)
            elif epoch_done and evaluating and evaluated_at != strategy.step:  # every epoch's end
                eval_due = epoch
                last_eval, eval_due = run_eval(epoch), None
                if callbacks is not None:
                    callbacks.agreed_stop()  # EarlyStopping on each epoch's evaluation: stop here
            if not epoch_done and total_steps is None:
                break  # an iterable that yields nothing would loop forever
        except Exception as exc:  # noqa: BLE001 - under --elastic a lost peer is not the end
            if not strategy.is_membership_change(exc):
                raise
            failed_at, switch = time.monotonic(), isinstance(exc, MembershipSwitch)
            cause = one_line(exc)
        if failed_at is not None:  # outside the except: its traceback (and the DDP it holds) is gone
            strategy.recover(failed_at, switch=switch, cause=cause)

    strategy.settle()  # the run ends on one set of weights (diloco: a sync, unless one just landed)
    if callbacks is not None:  # before the last checkpoint: EarlyStopping may put the best weights back
        callbacks.train_end()
    # Written again where a callback stopped the run (the step's checkpoint came before its evaluation,
    # so before the count that stopped it) or put weights back.
    again = callbacks is not None and (callbacks.stopped or callbacks.weights_loaded)
    if ckpt_dir and (last_saved != strategy.step or again):
        save(wait=True)  # nothing left to write it behind
    strategy.wait_for_checkpoint()  # --async-checkpoint: the last one is written before the summary
    final = None
    if last_loss is not None:  # weighted like the gradients: the global batch's mean loss
        final = float(strategy.reduce("mean", float(last_loss) * strategy.batch_weight))
    reporter.flush()
    return FitResult(steps=strategy.step, final_loss=final, eval_metrics=last_eval,
                     stopped_by=callbacks.reason if callbacks is not None and callbacks.stopped else None)
