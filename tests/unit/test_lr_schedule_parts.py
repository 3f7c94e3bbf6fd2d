"""The pieces of issue 47's schedules, in one process: the optimizer rebuild keeps what the recipe
set (or refuses it in one line), the schedule moves only on applied updates, its state comes
back from a checkpoint or is caught up without one, and the lr reaches the step events and
the live view."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from torch import nn

from distrun.errors import RecipeError
from distrun.protocol import Step
from distrun.protocol.events import decode_event, encode_event
from distrun.protocol.snapshot import JobSnapshot
from distrun.runtime._schedule import LrSchedule, build_schedule
from distrun.strategies.sharding.apply import parameter_names, rebuild_optimizer
from distrun.ui.train import render_progress


def _model_and_optimizer():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight], "lr": 0.5, "group": "decay"},
                                   {"params": [model.bias], "weight_decay": 0.0}], lr=0.1)
    return model, optimizer


def test_the_rebuild_keeps_hooks_group_options_and_the_recipes_attributes():
    model, optimizer = _model_and_optimizer()
    seen = []

    def hook(opt, args, kwargs):
        seen.append(opt)
        for group in opt.param_groups:
            group["lr"] = opt.peak / 10

    optimizer.register_step_pre_hook(hook)
    optimizer.peak = 0.3  # the recipe's own attribute, read by its hook
    rebuilt = rebuild_optimizer(optimizer, model, parameter_names(model))
    assert rebuilt is not optimizer
    assert rebuilt.param_groups[0]["group"] == "decay" and rebuilt.param_groups[0]["lr"] == 0.5
    assert rebuilt.param_groups[1]["weight_decay"] == 0.0 and rebuilt.param_groups[1]["lr"] == 0.1
    model(torch.ones(1, 2)).sum().backward()
    rebuilt.step()
    assert seen == [rebuilt] and [g["lr"] for g in rebuilt.param_groups] == [pytest.approx(0.03)] * 2


@pytest.mark.parametrize("replace, says", [
    (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2), "the optimizer has an lr scheduler built on it"),
    (lambda opt: setattr(opt, "step", lambda: None), "the optimizer's step was replaced on the object"),
])
def test_what_the_rebuild_cannot_carry_is_refused_in_one_line(replace, says):
    model, optimizer = _model_and_optimizer()
    replace(optimizer)
    with pytest.raises(RecipeError) as caught:
        rebuild_optimizer(optimizer, model, parameter_names(model))
    assert caught.value.exit_code == 3 and "\n" not in str(caught.value) and says in str(caught.value)


def _schedule(factor=lambda step: 0.5 ** step):
    model, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return model, optimizer, LrSchedule([scheduler], [optimizer], "loss")


def test_the_schedule_moves_only_when_the_update_was_applied():
    model, optimizer, schedule = _schedule()
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    schedule.after_step(True)
    schedule.after_step(True)  # no optimizer step since (a skipped update): the hooks saw none
    assert schedule.schedulers[0].last_epoch == 1 and schedule.lr == pytest.approx(0.25)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_a_checkpoints_state_comes_back_and_none_catches_up_by_the_step():
    _, _, saved = _schedule()
    for _ in range(3):
        saved.schedulers[0].step()
    _, optimizer, schedule = _schedule()
    optimizer.param_groups[0]["lr"] = 123.0  # what an optimizer state might have put there
    schedule.load_state_dict(saved.state_dict(), step=3)
    assert schedule.schedulers[0].last_epoch == 3 and schedule.lr == pytest.approx(0.5 * 0.5 ** 3)
    _, _, fresh = _schedule()
    fresh.load_state_dict(None, step=2)  # a checkpoint written before the recipe had a schedule
    assert fresh.schedulers[0].last_epoch == 2 and fresh.lr == pytest.approx(0.5 * 0.25)


def _recipe(**functions):
    return SimpleNamespace(**functions)


def _spec(strategy="one-device"):
    return SimpleNamespace(recipe="r.py", strategy=SimpleNamespace(name=strategy))


def _strategy(optimizers):
    return SimpleNamespace(lr_optimizers=lambda: optimizers)


def test_build_refuses_what_is_not_a_scheduler_a_plateau_without_evaluation_and_an_unknown_monitor():
    _, optimizer = _model_and_optimizer()
    with pytest.raises(RecipeError, match="scheduler\\(\\) returned AdamW; it must return"):
        build_schedule(_recipe(scheduler=lambda opt: opt), _strategy([optimizer]), _spec(), optimizer)
    with pytest.raises(RecipeError, match="the recipe has no eval_data, so it would never move"):
        build_schedule(_recipe(scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau), _strategy([optimizer]),
                       _spec(), optimizer)
    plateau = build_schedule(_recipe(scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau, eval_data=None,
                                     scheduler_monitor="eval_accuracy"), _strategy([optimizer]), _spec(), optimizer)
    with pytest.raises(RecipeError, match="scheduler_monitor = 'eval_accuracy' is not an evaluation metric; "
                                          "the evaluation gives: eval_loss"):
        plateau.after_eval({"loss": 1.0})


def test_build_schedules_every_optimizer_the_strategy_steps():
    """--pp: one scheduler per stage optimizer, moved together once both stepped."""
    parts = [_model_and_optimizer() for _ in range(2)]
    schedule = build_schedule(_recipe(scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)),
                              _strategy([opt for _, opt in parts]), _spec(), None)
    assert len(schedule.schedulers) == 2
    for model, optimizer in parts:
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    schedule.after_step(True)
    assert [opt.param_groups[1]["lr"] for _, opt in parts] == [pytest.approx(0.05)] * 2


def test_the_step_events_lr_round_trips_an_old_line_reads_and_the_live_view_shows_it():
    step = Step(rank=0, time=1.0, step=3, epoch=0, loss=1.0, samples_per_s=2.0, mem_mb=1.0, lr=2.5e-4)
    assert decode_event(encode_event(step)).lr == 2.5e-4
    old = encode_event(step).decode().replace(',"lr":0.00025', "")
    assert '"lr"' not in old and decode_event(old).lr is None
    snapshot = JobSnapshot(recipe="r.py", strategy="mirrored", rows=(), step=3, total_steps=10, elapsed_s=1.0)
    console = Console(width=160, record=True)
    console.print(render_progress(dataclasses.replace(snapshot, lr=2.5e-4)))
    assert "lr 0.00025" in console.export_text()
    console = Console(width=160, record=True)
    console.print(render_progress(snapshot))
    assert " lr " not in console.export_text()


def test_an_fp16_step_the_scaler_skips_does_not_move_the_schedule():
    """The scaler skips an overflowing step without calling the optimizer's step: the schedule
    (built on that optimizer, as the fit loop builds it) stays; the next clean step moves it."""
    from distrun.strategies.step.precision import LossScaler, ScaledOptimizer

    model, optimizer, schedule = _schedule()
    scaled = ScaledOptimizer(optimizer, list(model.parameters()), LossScaler(lambda found: found, init_scale=4.0))
    model(torch.ones(1, 2)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    scaled.step()
    schedule.after_step(True)  # the loop allowed it; the scaler skipped it
    assert scaled.scaler.scale == 2.0 and schedule.schedulers[0].last_epoch == 0
    model.weight.grad.zero_()
    scaled.step()
    schedule.after_step(True)
    assert schedule.schedulers[0].last_epoch == 1 and schedule.lr == pytest.approx(0.25)


def test_a_push_carries_the_workers_lr_factor_as_float64_bits():
    from distrun.strategies.ps.channel import Op, PeerRefused, lr_factor_word, push_lr_factor

    assert push_lr_factor([Op.PUSH, 0, 0, lr_factor_word(0.125), 0, 0, 0, 0]) == 0.125
    assert push_lr_factor([Op.PUSH, 0, 0, 0, 0, 0, 0, 0]) == 1.0  # a worker that sends none
    with pytest.raises(PeerRefused, match="an lr factor must be a finite number >= 0"):
        push_lr_factor([Op.PUSH, 0, 0, lr_factor_word(float("nan")), 0, 0, 0, 0])


def test_the_live_view_shows_the_chiefs_learning_rate():
    """The chief's newest step's lr reaches the snapshot and the live table (another rank's does not)."""
    from rich.console import Console

    from distrun.client._tracker import JobTracker
    from distrun.protocol import Step
    from distrun.ui import render_progress

    tracker = JobTracker("r.py", "mirrored", replicas=2, started_at=0.0)
    assert tracker.snapshot().lr is None
    tracker.update(Step(rank=0, time=1.0, step=3, epoch=0, loss=0.5, samples_per_s=10.0, mem_mb=1.0, lr=2.5e-4))
    tracker.update(Step(rank=1, time=1.0, step=3, epoch=0, loss=0.5, samples_per_s=10.0, mem_mb=1.0, lr=9.0))
    assert tracker.snapshot().lr == 2.5e-4
    console = Console(width=140, record=True)
    console.print(render_progress(tracker.snapshot()))
    assert "lr 0.00025" in console.export_text()
