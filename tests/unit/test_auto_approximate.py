"""``--auto-approximate`` (issue 48), called directly: which approximate layouts are worth a race,
what the model predicts for them, and how a race's eval-loss curves are judged."""

from __future__ import annotations

import pytest

from distrun.cli._auto_race import race
from distrun.client.planning import Plan
from distrun.errors import DistrunError
from distrun.planner.approximate import (RACE_GAIN, RACE_MARGIN, Curve, approximate_layouts,
                                         diloco_prediction, judge, race_steps)
from distrun.planner.choose import decide, retime
from distrun.planner.cost import Layout, Link, ModelProfile, Resources, predict
from distrun.protocol import Eval, Step
from tests.unit.test_planner import FAST, MB, PROFILE, SLOW


def _resources(budget_mb: float, link: Link) -> Resources:
    return Resources(ranks=2, hosts=1, budget_bytes=int(budget_mb * MB), within_host=link, ddp_step_s=0.004,
                     loop_step_s=0.006)


def test_diloco_pays_the_models_all_reduce_once_every_h_steps_and_keeps_the_global_weights():
    resources = _resources(10_000, SLOW)
    mirrored = predict(PROFILE, resources, Layout("mirrored", 2), 64)
    diloco = diloco_prediction(PROFILE, resources, mirrored, 64, 16)
    assert diloco.layout == Layout("diloco", 2, sync_every=16) and not diloco.layout.exact
    assert diloco.exposed_comm_s == pytest.approx(mirrored.exposed_comm_s / 16)
    assert diloco.fixed_s == pytest.approx(mirrored.fixed_s - resources.ddp_step_s)  # no DDP
    assert diloco.step_s == pytest.approx(mirrored.compute_s + mirrored.exposed_comm_s / 16 + diloco.fixed_s)
    # DDP's buckets (a gradient's bytes) go; the global weights and the outer momentum come.
    assert diloco.peak_bytes - mirrored.peak_bytes == 2 * PROFILE.parameter_bytes - PROFILE.gradient_bytes
    assert diloco.layout.describe() == "diloco x2 --sync-every 16"
    assert diloco.layout.flags()["sync_every"] == 16 and diloco.layout.job_file()["diloco"] == {"sync_every": 16}


def test_on_a_slow_link_both_are_raced_and_diloco_syncs_often_enough_to_be_seen():
    resources = _resources(10_000, SLOW)
    decision = decide(PROFILE, resources, 64)
    mirrored = next(p for p, _ in decision.ranked if p.layout == Layout("mirrored", 2))
    raced, why = approximate_layouts(decision.ranked, mirrored, PROFILE, resources, 64, exact_steps=12)
    assert why == "" and [r.prediction.layout.strategy for r in raced] == ["diloco", "mirrored"]
    diloco, bf16 = (r.prediction for r in raced)
    assert all(r.expected_step_s == r.prediction.step_s for r in raced)  # nothing timed: the model's own
    assert bf16.layout.compression == "bf16" and bf16.exposed_comm_s == pytest.approx(mirrored.exposed_comm_s / 2)
    assert bf16.layout.describe() == "mirrored x2 --compression bf16"
    assert bf16.layout.job_file()["communication"] == {"compression": "bf16"}
    # The longest interval its race run (as many steps as fit the exact run's 12, up to 8x them) syncs 4 times in.
    every = diloco.layout.sync_every
    assert race_steps(12, mirrored.step_s, diloco.step_s) == 96 and every == 16
    assert race_steps(12, 1.0, 0.5) == 24 and race_steps(12, 1.0, 2.0) == 12


def test_on_a_fast_link_none_is_raced_and_the_line_says_why():
    resources = _resources(10_000, FAST)
    decision = decide(PROFILE, resources, 64)
    raced, why = approximate_layouts(decision.ranked, decision.chosen, PROFILE, resources, 64, exact_steps=12)
    assert raced == []
    assert why.startswith(f"none is predicted {RACE_GAIN:.1f}x faster a step than mirrored x2's ") and "waits" in why


def test_the_model_is_held_to_what_the_trials_measured():
    """A trial timed mirrored at 3x the model's step (short CPU steps are): the candidates' steps are
    scaled alike before they are compared with it, so a fast link's bf16 is not raced on the model's word."""
    resources = _resources(10_000, FAST)
    decision = decide(PROFILE, resources, 64)
    timed = retime(decision, {decision.chosen.layout: 3 * decision.chosen.step_s})
    raced, why = approximate_layouts(timed.ranked, timed.chosen, PROFILE, resources, 64, exact_steps=12)
    assert raced == [] and why.startswith("none is predicted")
    slow = _resources(10_000, SLOW)
    timed = retime(decide(PROFILE, slow, 64), {Layout("mirrored", 2): 2 * predict(PROFILE, slow, Layout("mirrored", 2),
                                                                                   64).step_s})
    mirrored = next(p for p, _ in timed.ranked if p.layout == Layout("mirrored", 2))
    raced, _ = approximate_layouts(timed.ranked, mirrored, PROFILE, slow, 64, exact_steps=12)
    assert raced and all(r.expected_step_s == pytest.approx(2 * r.prediction.step_s) for r in raced)


def test_diloco_syncs_at_intervals_the_job_allows():
    resources = _resources(10_000, SLOW)
    decision = decide(PROFILE, resources, 64)
    mirrored = next(p for p, _ in decision.ranked if p.layout == Layout("mirrored", 2))
    raced, _ = approximate_layouts(decision.ranked, mirrored, PROFILE, resources, 64, exact_steps=12,
                                   sync_every_ok=lambda h: 30 % h == 0)  # --checkpoint-every 30
    assert [r.prediction.layout.sync_every for r in raced if r.prediction.layout.strategy == "diloco"] == [2]
    raced, why = approximate_layouts(decision.ranked, mirrored, PROFILE, resources, 64, exact_steps=12,
                                     sync_every_ok=lambda h: False)
    assert [r.prediction.layout.strategy for r in raced] == ["mirrored"]
    one = Resources(ranks=1, hosts=1, budget_bytes=10**10, within_host=SLOW)
    assert approximate_layouts(decide(PROFILE, one, 64).ranked, decide(PROFILE, one, 64).chosen, PROFILE, one, 64,
                               12)[1].startswith("one rank")


def test_without_a_data_parallel_layout_that_fits_nothing_is_raced():
    mirrored_need = predict(PROFILE, _resources(1, SLOW), Layout("mirrored", 2), 64).peak_bytes / MB
    resources = _resources(mirrored_need * 0.8, SLOW)
    decision = decide(PROFILE, resources, 64)
    raced, why = approximate_layouts(decision.ranked, decision.chosen, PROFILE, resources, 64, exact_steps=12)
    assert raced == [] and why.startswith("no data-parallel layout fits")


def test_seconds_to_a_loss_interpolate_between_evaluations_in_steps_times_the_step():
    curve = Curve(Layout("diloco", 2, sync_every=4), 0.5, ((4, 2.0), (8, 1.0), (12, 0.8)))
    assert curve.seconds_to(2.0) == pytest.approx(4 * 0.5)
    assert curve.seconds_to(1.5) == pytest.approx(6 * 0.5)  # halfway from step 4 (2.0) to step 8 (1.0)
    assert curve.seconds_to(0.8) == pytest.approx(12 * 0.5)
    assert curve.seconds_to(0.7) is None
    assert curve.seconds_to(5.0) == pytest.approx(4 * 0.5)  # already under at its first evaluation


def test_an_approximate_layout_wins_only_when_it_reaches_the_exact_loss_clearly_sooner():
    exact = Curve(Layout("mirrored", 2), 1.0, ((5, 1.5), (10, 1.0)))  # 1.0 at step 10: 10 s
    fast = Curve(Layout("diloco", 2, sync_every=5), 0.2, ((10, 1.4), (20, 1.1), (30, 0.9)))  # 1.0 at step 25: 5 s
    close = Curve(Layout("mirrored", 2, compression="bf16"), 0.9, ((5, 1.5), (10, 1.0)))  # 9 s: 10% sooner only
    never = Curve(Layout("diloco", 2, sync_every=8), 0.1, ((8, 1.3), (16, 1.2)))
    target, exact_s, verdicts = judge(exact, [close, fast, never])
    assert (target, exact_s) == (1.0, pytest.approx(10.0))
    assert [v.chosen for v in verdicts] == [False, True, False]
    assert verdicts[1].seconds == pytest.approx(5.0) and verdicts[2].seconds is None
    assert 9.0 > 10.0 * (1 - RACE_MARGIN)  # why close lost: under 15% sooner
    assert "2.00x sooner" in verdicts[1].said(target, exact_s)
    assert verdicts[2].said(target, exact_s).startswith("did not reach eval_loss 1 in 16 steps (1.2 at best)")
    _, _, alone = judge(exact, [close])
    assert [v.chosen for v in alone] == [False]


# -- the race itself, with a stand-in for the runs (the integration test runs real jobs) --------------


#: No chain, so no pipeline: on the slow link the exact choice is mirrored x2, nearly all of its step
#: on the link (sharded's gathers cost more), and both approximate layouts are worth a race.
CHAINLESS = ModelProfile(**{**PROFILE.__dict__, "chain_parts": 0})


def _plan(resources: Resources) -> Plan:
    plan = Plan(decide(CHAINLESS, resources, 64), resources, CHAINLESS, 64, decide_s=10.0, probe_s=8.0,
                budget_source="test")
    assert plan.decision.chosen.layout == Layout("mirrored", 2)
    return plan


def _runner(curves: dict[str, tuple[float, list[float]]], seen: list, sync_s: float = 0.0):
    """A race run as its events: the layout's (step_s, eval losses by evaluation), each evaluation at
    its interval, the chief's Step windows of one step each (the reporter leaves evaluations out);
    diloco's step before each evaluation also syncs, ``sync_s`` longer."""
    def run(spec, deadline, on_event):
        layout, steps, every = spec
        seen.append((layout.describe(), steps, every))
        step_s, losses = curves[layout.strategy + layout.compression]
        for step in range(1, steps + 1):
            syncs = layout.strategy == "diloco" and step % every == 0
            on_event(Step(rank=0, time=0.0, step=step, epoch=0, loss=1.0, samples_per_s=1.0, mem_mb=1.0,
                          step_ms=None if step == 1 else (step_s + (sync_s if syncs else 0.0)) * 1e3))
            if step % every == 0:
                loss = losses[min(step // every, len(losses)) - 1]
                on_event(Eval(rank=0, time=0.0, step=step, epoch=0, metrics={"loss": loss}))
        return 99.0  # the trial's figure (steady_s): never the race's, which is the windows' mean
    return run


def test_a_race_chooses_by_its_curves_and_the_plan_says_why():
    plan = _plan(_resources(10_000, SLOW))
    exact = plan.decision.chosen
    seen: list = []
    run = _runner({exact.layout.strategy + "none": (exact.step_s, [2.0, 1.8, 1.6, 1.4, 1.2, 1.0]),
                   "diloco" + "none": (exact.step_s / 20, [1.5, 0.9, 0.8, 0.7, 0.6, 0.5]),
                   "mirrored" + "bf16": (exact.step_s / 1.5, [2.5, 2.4, 2.3, 2.2, 2.1, 2.0])}, seen,
                  sync_s=exact.step_s / 4)
    raced = race(plan, lambda layout, steps, every: (layout, steps, every), run)
    exact_run, *runs = seen
    assert exact_run == (exact.layout.describe(), 12, 2)  # 12 steps (the least), 6 evaluations
    assert [name.split(" x2")[0] for name, _, _ in runs] == ["diloco", "mirrored"]
    figures = raced.race
    assert figures["target"] == 1.0 and figures["exact"]["step_s"] == pytest.approx(exact.step_s)
    chosen = raced.decision.chosen.layout
    assert chosen.strategy == "diloco" and figures["raced"][0]["chosen"] and not figures["raced"][1]["chosen"]
    assert figures["raced"][1]["seconds_to_target"] is None  # bf16 never got to 1.0
    # diloco's step is its windows' mean: its syncs (the steps before its evaluations) counted in.
    _, n, every = runs[0]
    syncs = sum(1 for step in range(2, n + 1) if step % every == 0)
    assert raced.decision.chosen.timed_step_s == pytest.approx(exact.step_s / 20 + exact.step_s / 4 * syncs / (n - 1))
    assert raced.decision.chosen.timed_step_s > exact.step_s / 20 * 1.25  # a median would have read 1/20
    assert raced.decision.ranked[1] == (exact, raced.decision.ranked[1][1])
    assert raced.decision.ranked[1][1].startswith("exact, reached its own eval_loss 1 ")
    lines = raced.lines()
    assert lines[0].startswith(f"auto: {chosen.describe()}: ")
    assert any(line.startswith("auto --auto-approximate: raced to ") and f"chose {chosen.describe()}" in line
               for line in lines), lines
    assert raced.summary_object(None, None)["race"]["raced"][0]["layout"] == chosen.describe()
    assert raced.decide_s >= plan.decide_s


def test_a_race_keeps_the_exact_layout_where_nothing_gets_there_sooner_and_says_what_failed():
    plan = _plan(_resources(10_000, SLOW))
    exact = plan.decision.chosen

    def run(spec, deadline, on_event):
        layout, steps, every = spec
        if layout.strategy == "diloco":
            raise DistrunError("")  # a failure with no words is still one line
        on_event(Eval(rank=0, time=0.0, step=every, epoch=0, metrics={"loss": 2.0}))
        on_event(Eval(rank=0, time=0.0, step=steps, epoch=0, metrics={"loss": float("nan")}))
        on_event(Eval(rank=0, time=0.0, step=steps, epoch=0, metrics={"loss": flat.get(layout.strategy, 1.0)}))
        return exact.step_s
    flat: dict[str, float] = {}
    raced = race(plan, lambda layout, steps, every: (layout, steps, every), run)
    assert raced.decision.chosen == exact
    said = raced.race["said"]
    assert said[0].endswith(f"kept {exact.layout.describe()} (an approximate layout must get there 15% sooner)"), said
    assert any(line.endswith(": failed in its race: DistrunError") for line in said), said
    refused = race(plan, lambda layout, steps, every: (layout, steps, every), run,
                   check=lambda layout: "--sync-batch-norm with --strategy diloco: ..." if layout.strategy == "diloco"
                   else "no")
    assert refused.race["raced"] == [] and refused.race["said"][0] == \
        "auto --auto-approximate: no approximate layout raced"
    assert any("not raced: --sync-batch-norm" in line for line in refused.race["said"])
    flat["mirrored"] = 1.99  # a curve that hardly falls has no target worth a race
    unjudged = race(plan, lambda layout, steps, every: (layout, steps, every), run)
    assert unjudged.decision.chosen == exact and unjudged.race["raced"] == []
    assert unjudged.race["said"][0].startswith("auto --auto-approximate: the exact layout's eval_loss did not fall "
                                               "by 2% in its race run (2 at step 2, 1.99 at step 12)"), unjudged.race


def test_the_measured_peak_is_said_in_the_planners_megabytes():
    """The ranks count MiB (CUDA's max allocated, VmHWM), the plan MB: beside the prediction the
    measured peak is in the plan's unit (an H200's 1,530.1 MiB read as 1,530 MB against a 1,538
    MB prediction, 4.9% off the truth)."""
    from distrun.cli._auto import with_measured
    from distrun.protocol import JobSummary

    summary = JobSummary("succeeded", "r.py", "mirrored", 2, 10, 0.1, samples_per_s=32.0, time_to_first_step_s=1.0,
                         wall_s=2.0, peak_mem_mb={"0": 1000.0, "1": 1530.1484375})
    said = with_measured(_plan(_resources(10_000, SLOW)), summary).plan
    assert said["measured_peak_mb"] == pytest.approx(1604.5, abs=0.1)  # the highest rank's, in 10**6 bytes
    assert said["measured_step_s"] == pytest.approx(64 / 32.0)
