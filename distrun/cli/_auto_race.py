"""``--auto-approximate``'s race: the exact layout auto chose against the approximate ones worth it.

The layouts that change the arithmetic (planner/approximate.py: ``--compression bf16`` and
``diloco``) are judged by how long they take to reach the same eval loss, not by samples/s. So,
once the exact decision is made (probe and trials, cli/_auto_trials.py), each is trained for real
beside the exact layout, from the same seed on the same batches, evaluating as it goes:

- the exact layout runs about :data:`RACE_S` seconds of steps (at least :data:`_MIN_STEPS`),
  evaluating :data:`_EVALS` times; its last eval loss is the target, where it fell at least
  :data:`MIN_FALL` from the first (else the race cannot judge, and the exact layout is kept);
- an approximate layout runs the steps its predicted step fits into the same seconds (at most
  ``MAX_STEPS_FACTOR`` times the exact run's), evaluating as often (diloco: right after a sync);
- each layout's time to the target is its steps to it (interpolated between evaluations) times
  its measured mean step (from the chief's Step events after step 1, which leave the evaluations
  out), so neither the start nor an evaluation is charged to either side (the warm-up steps after
  step 1 are: the same ones for every layout);
- the whole race stays within :data:`RACE_BUDGET_S`, beyond the exact decision's 30 s; a run
  still going then is stopped and its layout is not chosen.

An approximate layout is chosen only where it reached the target :data:`RACE_MARGIN` sooner; the
plan says every race's figures either way (``plan.race`` in ``--json``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from distrun.cli._auto_trials import OverBudget, StepWindows
from distrun.client.planning import Plan
from distrun.config import JobSpec
from distrun.errors import DistrunError
from distrun.planner.approximate import RACE_MARGIN, Curve, Verdict, approximate_layouts, judge, race_steps
from distrun.planner.choose import Decision
from distrun.planner.cost import Layout, Prediction
from distrun.protocol import Eval, Event

__all__ = ["RACE_BUDGET_S", "RACE_S", "race"]

#: The exact layout's run fills about this many seconds of steps.
RACE_S = 6.0
#: The race, every run's start and evaluations included, stays within this.
RACE_BUDGET_S = 45.0
_MIN_STEPS, _MAX_STEPS = 12, 600
_EVALS = 6
#: The exact run's last eval loss must be this share under its first: a flat or noisy curve's target
#: is reached by chance (seen: a loss of 2.301 at every evaluation, "reached" 8.6x sooner by diloco).
MIN_FALL = 0.02

#: ``run(spec, deadline, on_event)``: a race run's seconds a step (as a trial's), each event handed on.
Runner = Callable[[JobSpec, float, Callable[[Event | None], None]], float]


def _steps(exact_step_s: float) -> tuple[int, int]:
    """The exact run's steps and its evaluation interval (the steps a multiple of it, :data:`_EVALS` evaluations)."""
    steps = max(_MIN_STEPS, min(_MAX_STEPS, math.ceil(RACE_S / max(exact_step_s, 1e-4))))
    every = math.ceil(steps / _EVALS)
    return every * _EVALS, every


def _approximate_steps(layout: Layout, steps: int, exact_step_s: float, expected_s: float) -> tuple[int, int]:
    """An approximate run's steps (``race_steps``) and its evaluation interval, about :data:`_EVALS`
    evaluations; diloco's a multiple of its sync interval, so that each evaluation follows a sync."""
    wanted = race_steps(steps, exact_step_s, expected_s)
    unit = layout.sync_every if layout.strategy == "diloco" else 1
    every = unit * max(1, math.ceil(wanted / unit / _EVALS))
    return math.ceil(wanted / every) * every, every


def _run(run: Runner, spec: JobSpec, deadline: float, layout: Layout) -> Curve:
    """A race run's curve: its finite eval losses by step, and its mean step from the chief's Step
    events (each a window of steps' wall time; the reporter leaves the evaluations out, and a
    diloco sync is inside its step's); the summary's where no window came."""
    points: list[tuple[int, float]] = []
    windows = StepWindows()

    def seen(event: Event | None) -> None:
        if isinstance(event, Eval) and math.isfinite(float(event.metrics.get("loss", math.nan))):
            points.append((event.step, float(event.metrics["loss"])))
        windows.see(event)
    step_s = run(spec, deadline, seen)
    last = {step: loss for step, loss in points}  # a final evaluation may repeat the last interval's
    return Curve(layout, windows.mean_s() or step_s, tuple(sorted(last.items())))


def race(plan: Plan, make_spec: Callable[[Layout, int, int], JobSpec], run: Runner, *,
         check: Callable[[Layout], str | None] = lambda _: None,
         sync_every_ok: Callable[[int], bool] = lambda _: True) -> Plan:
    """``plan`` after the race (see the module): the decision's chosen layout replaced where an
    approximate one won; ``plan.race`` holds the figures and the lines said. ``make_spec(layout,
    steps, eval_every)``: a race run's job; ``check(layout)``: why the job the user asked for cannot
    run under ``layout`` (None: it can), so no layout is raced that the job would then refuse;
    ``sync_every_ok(H)``: whether the job's own steps and checkpoints allow diloco's interval H."""
    started = time.perf_counter()
    deadline = started + RACE_BUDGET_S
    exact = plan.decision.chosen
    steps, every = _steps(exact.expected_step_s)
    found, why_none = approximate_layouts(plan.decision.ranked, exact, plan.profile, plan.resources,
                                          plan.global_batch, steps, sync_every_ok)
    lines: list[str] = []
    candidates = []
    for raced in found:
        refused = check(raced.prediction.layout)
        if refused is None:
            candidates.append(raced)
        else:
            lines.append(f"  {raced.prediction.layout.describe()}: not raced: {refused}")
    if not candidates:
        said = ["auto --auto-approximate: no approximate layout raced" + (f": {why_none}" if why_none else ""), *lines]
        return dataclasses.replace(plan, race={"raced": [], "said": said})

    def kept(why: str) -> Plan:
        said = [f"auto --auto-approximate: {why}; kept {exact.layout.describe()}", *lines]
        return dataclasses.replace(plan, race={"raced": [], "said": said}, decide_s=plan.decide_s + _since(started))
    try:
        exact_curve = _run(run, make_spec(exact.layout, steps, every), deadline, exact.layout)
    except OverBudget:
        return kept(f"the exact layout's race run ran past the race's {RACE_BUDGET_S:.0f} s")
    except DistrunError as exc:
        return kept(f"the exact layout's race run failed: {_first_line(exc)}")
    if not exact_curve.points:
        return kept("the exact layout's race run evaluated no finite eval_loss")
    (first_step, first), (last_step, last) = exact_curve.points[0], exact_curve.points[-1]
    if len(exact_curve.points) < 2 or last > first * (1 - MIN_FALL):
        return kept(f"the exact layout's eval_loss did not fall by {MIN_FALL:.0%} in its race run ({first:.4g} at "
                    f"step {first_step}, {last:.4g} at step {last_step}): a race that short cannot tell the layouts "
                    "apart")
    curves: list[Curve] = []
    predicted: dict[Layout, Prediction] = {}
    for candidate in candidates:
        layout = candidate.prediction.layout
        n, each = _approximate_steps(layout, steps, exact_curve.step_s, candidate.expected_step_s)
        try:
            curve = _run(run, make_spec(layout, n, each), deadline, layout)
        except OverBudget:
            lines.append(f"  {layout.describe()}: ran past the race's {RACE_BUDGET_S:.0f} s; not chosen")
            break
        except DistrunError as exc:
            lines.append(f"  {layout.describe()}: failed in its race: {_first_line(exc)}")
            continue
        curves.append(curve)
        predicted[layout] = candidate.prediction
    target, exact_s, verdicts = judge(exact_curve, curves)
    winner = next((v for v in verdicts if v.chosen), None)
    head = (f"auto --auto-approximate: raced to {exact.layout.describe()}'s last eval_loss {target:.4g} (step "
            f"{exact_curve.points[-1][0]}; first reached in {exact_s:.3g} s of steps at {exact_curve.step_s:.3g} "
            "s/step): ")
    if winner is not None and winner.seconds is not None:
        head += f"chose {winner.curve.layout.describe()}, {exact_s / max(winner.seconds, 1e-9):.2f}x sooner"
    else:
        head += f"kept {exact.layout.describe()} (an approximate layout must get there {RACE_MARGIN:.0%} sooner)"
    lines = [head, *(f"  {v.curve.layout.describe()}: {v.said(target, exact_s)}" for v in verdicts), *lines]
    decision = _with_race(plan.decision, exact_curve, verdicts, predicted, winner.curve.layout if winner else None,
                          target, exact_s)
    figures = {"metric": "eval_loss", "target": target, "exact": exact_curve.to_json(), "exact_s": exact_s,
               "raced": [{**v.curve.to_json(), "seconds_to_target": v.seconds, "chosen": v.chosen} for v in verdicts],
               "said": lines}
    return dataclasses.replace(plan, decision=decision, race=figures, decide_s=plan.decide_s + _since(started))


def _first_line(exc: DistrunError) -> str:
    lines = str(exc.message).splitlines()
    return lines[0] if lines else type(exc).__name__


def _since(started: float) -> float:
    return time.perf_counter() - started


def _with_race(decision: Decision, exact_curve: Curve, verdicts: list[Verdict], predicted: dict[Layout, Prediction],
               winner: Layout | None, target: float, exact_s: float) -> Decision:
    """The decision with the raced layouts among its candidates, each with its race's verdict (after
    the exact ones: ``runners_up`` names exact layouts, the race's lines these); a winner becomes the
    chosen one, its race's step its predicted one."""
    raced = [(dataclasses.replace(predicted[v.curve.layout], timed_step_s=v.curve.step_s), v.said(target, exact_s))
             for v in verdicts]
    exact = decision.chosen
    if winner is None:
        return Decision(exact, (*decision.ranked, *raced), decision.budget_mb)
    chosen = next(p for p, _ in raced if p.layout == winner)
    exact_verdict = (f"exact, reached its own eval_loss {target:.4g} in {exact_s:.3g} s of steps "
                     f"({exact_curve.step_s:.3g} s/step)")
    others = [(p, said) for p, said in raced if p.layout != winner]
    return Decision(chosen, ((chosen, "chosen"), (exact, exact_verdict), *decision.ranked[1:], *others),
                    decision.budget_mb)
