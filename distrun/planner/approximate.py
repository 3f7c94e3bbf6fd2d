"""``--auto-approximate``: the layouts that change the arithmetic, and how a race between them is judged.

By default ``--strategy auto`` chooses among exact layouts only: whichever it picks, the run ends
with one-device's parameters. Two layouts trade that for fewer bytes on the links:

- ``--compression bf16`` (mirrored, multi-worker): DDP's gradient buckets cross the wire in
  bfloat16, half the bytes, with the rounding that brings;
- ``diloco --sync-every H``: each replica takes H steps alone, then the replicas average their
  pseudo-gradients once, an outer optimizer applying it (docs/strategies.md#diloco).

(PowerSGD is left out: its first ``--powersgd-warmup`` steps are plain all-reduces, longer than a
race, and its bytes depend on every matrix's shape, which the probe does not keep.)

A faster step says nothing about whether such a layout trains as well, so the cost model only
picks which are worth a race (:func:`approximate_layouts`: those it puts at least
:data:`RACE_GAIN` faster a step than the exact layout chosen). The race itself, run by the CLI
(cli/_auto_race.py), trains the exact layout and each of these from the same seed on the same
batches, evaluating as it goes; :func:`judge` then asks how long each took, in steps times its
measured step, to reach the eval loss the exact layout ended its run at. An approximate layout is
chosen only where it got there at least :data:`RACE_MARGIN` sooner.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from distrun.planner.cost import Layout, ModelProfile, Prediction, Resources, fits, predict

__all__ = ["APPROXIMATE_COMPRESSION", "MAX_STEPS_FACTOR", "RACE_GAIN", "RACE_MARGIN", "SYNC_EVERY", "Curve", "Raced", "Verdict",
           "approximate_layouts", "diloco_prediction", "judge", "race_steps"]

#: The compression raced: bf16 keeps float32's range (fp16 would need loss scaling on some models).
APPROXIMATE_COMPRESSION = "bf16"
#: An approximate layout is raced only where the model puts its step at least this much faster than
#: the exact layout's: it seldom learns more a step, so a smaller gain cannot pay for what it loses.
RACE_GAIN = 1.2
#: ...and chosen only where it reached the exact layout's eval loss this share of the time sooner: the
#: race is short, and an eval loss a few steps apart moves by about that much.
RACE_MARGIN = 0.15
#: diloco's sync intervals tried, largest first: the race must see at least :data:`_SYNCS_SEEN` syncs.
SYNC_EVERY = (100, 64, 32, 16, 8, 4, 2)
_SYNCS_SEEN = 4
#: An approximate layout's race run takes at most this many times the exact run's steps.
MAX_STEPS_FACTOR = 8


def race_steps(exact_steps: int, exact_step_s: float, predicted_step_s: float) -> int:
    """An approximate layout's steps in a race: as many as its predicted step fits into the exact run's
    seconds, at least the exact run's and at most :data:`MAX_STEPS_FACTOR` times them."""
    fitting = math.ceil(exact_steps * exact_step_s / max(predicted_step_s, 1e-6))
    return max(exact_steps, min(MAX_STEPS_FACTOR * exact_steps, fitting))


def _data_parallel(ranked: tuple[tuple[Prediction, str], ...]) -> Prediction | None:
    """The plain data-parallel layout (DDP: no pipeline, no --tp, not sharded) the approximate ones
    build on: without accumulation or checkpointing where that fits, else the fastest by the model."""
    fitting = [prediction for prediction, verdict in ranked
               if prediction.layout.strategy in ("mirrored", "multi-worker") and prediction.layout.pp == 1
               and prediction.layout.tp == 1 and prediction.layout.exact and prediction.layout.replicas > 1
               and not verdict.startswith(("needs ", "failed in its trial"))]
    plain = [p for p in fitting if p.layout.accumulate == 1 and p.layout.activation_checkpointing == "none"]
    return min(plain or fitting, key=lambda p: p.step_s, default=None)


def diloco_prediction(profile: ModelProfile, resources: Resources, base: Prediction, global_batch: int,
                      sync_every: int) -> Prediction:
    """``diloco`` over ``base``'s replicas: its compute and loop, no DDP, and the model's all-reduce
    once every ``sync_every`` steps. Memory: DDP's buckets go; the global weights and the outer
    optimizer's momentum (a parameter's bytes each) come."""
    layout = replace(base.layout, strategy="diloco", sync_every=sync_every)
    fixed = max(0.0, base.fixed_s - resources.ddp_step_s)
    comm = base.exposed_comm_s / sync_every  # the same bytes (fp32 weights, as gradients), every H steps
    parts = dict(base.parts)
    parts["state"] = parts.get("state", 0) - profile.gradient_bytes + 2 * profile.parameter_bytes
    peak = int(sum(parts.values()))
    return Prediction(layout, peak, base.compute_s + comm + fixed, base.compute_s, comm, parts, fixed_s=fixed)


def _compressed(base: Prediction) -> Prediction:
    """DDP with bf16 buckets: half the bytes of its all-reduce (its latency unchanged, a small part)."""
    comm = base.exposed_comm_s / 2
    return replace(base, layout=replace(base.layout, compression=APPROXIMATE_COMPRESSION),
                   step_s=base.compute_s + comm + base.fixed_s, exposed_comm_s=comm, timed_step_s=None)


@dataclass(frozen=True)
class Raced:
    """An approximate layout worth a race: the model's prediction, and its step as this machine would
    take it (the model's, scaled by what the trials measured against the model for the layouts it
    is made from), from which its race run's steps are counted."""

    prediction: Prediction
    expected_step_s: float


def approximate_layouts(ranked: tuple[tuple[Prediction, str], ...], exact: Prediction, profile: ModelProfile,
                        resources: Resources, global_batch: int, exact_steps: int,
                        sync_every_ok: Callable[[int], bool] = lambda _: True) -> tuple[list[Raced], str]:
    """The approximate layouts worth a race against ``exact`` (the exact decision's choice) run for
    ``exact_steps``, best first, and, where there are none, why.

    The model's steps are off by a factor the trials measure (1.7-3.5x under for short CPU steps), so
    a candidate's step is the model's times that factor, the data-parallel layout's own where it was
    timed, else the exact choice's, and is compared with the exact choice's measured step. diloco's
    interval is the longest that ``sync_every_ok`` allows (the job's own steps and checkpoints) and
    its race run (:func:`race_steps`) syncs :data:`_SYNCS_SEEN` times in: a race must see it sync,
    and the interval raced is the one the job runs."""
    if resources.ranks < 2:
        return [], "one rank: no gradients cross a link to compress or sync less often"
    base = _data_parallel(ranked)
    if base is None:
        return [], "no data-parallel layout fits (compression and diloco keep a whole model a replica)"
    timed = base if base.timed_step_s is not None else exact
    scale = timed.expected_step_s / timed.step_s if timed.step_s > 0 else 1.0
    exact_s = exact.expected_step_s
    diloco = None
    for every in (h for h in SYNC_EVERY if sync_every_ok(h)):
        diloco = diloco_prediction(profile, resources, base, global_batch, every)
        if race_steps(exact_steps, exact_s, diloco.step_s * scale) >= _SYNCS_SEEN * every:
            break
    raced, left_out = [], []
    for prediction in (p for p in (diloco, _compressed(base)) if p is not None):
        if not fits(prediction, resources):
            left_out.append(f"{prediction.layout.describe()} needs {prediction.peak_bytes / 1e6:,.0f} MB a rank")
        elif prediction.step_s * scale * RACE_GAIN <= exact_s:
            raced.append(Raced(prediction, prediction.step_s * scale))
    raced.sort(key=lambda r: r.expected_step_s)
    if raced:
        return raced, ""
    if diloco is None:
        left_out.append("diloco: no --sync-every in " + ", ".join(map(str, SYNC_EVERY)) + " suits the job's "
                        "--steps and --checkpoint-every")
    why = (f"none is predicted {RACE_GAIN:.1f}x faster a step than {exact.layout.describe()}'s {exact_s:.3g} s "
           f"({base.layout.describe()} waits {base.comm_share:.0%} of its step on the links)")
    return [], "; ".join([why, *left_out])


@dataclass(frozen=True)
class Curve:
    """A raced run: its layout, its measured step (s) and its eval loss at each evaluated step."""

    layout: Layout
    step_s: float
    points: tuple[tuple[int, float], ...]

    def seconds_to(self, target: float) -> float | None:
        """Seconds of steps (steps x ``step_s``) to reach an eval loss of ``target``: the step found by
        linear interpolation between the evaluation before and the first at or under it; None if never."""
        before: tuple[int, float] | None = None
        for step, loss in sorted(self.points):
            if loss <= target:
                if before is None or before[1] <= target or before[1] == loss:
                    at = float(step)
                else:
                    at = before[0] + (step - before[0]) * (before[1] - target) / (before[1] - loss)
                return at * self.step_s
            before = (step, loss)
        return None

    def to_json(self) -> dict[str, object]:
        return {"layout": self.layout.describe(), "step_s": self.step_s,
                "points": [[step, loss] for step, loss in self.points]}


@dataclass(frozen=True)
class Verdict:
    """One approximate layout's race against the exact one: seconds to the target (None: not reached)."""

    curve: Curve
    seconds: float | None
    chosen: bool

    def said(self, target: float, exact_s: float) -> str:
        if self.seconds is None:
            best = min((loss for _, loss in self.curve.points), default=float("nan"))
            return (f"did not reach eval_loss {target:.4g} in {self.curve.points[-1][0] if self.curve.points else 0} "
                    f"steps ({best:.4g} at best), where the exact layout took {exact_s:.3g} s")
        ratio = exact_s / self.seconds if self.seconds > 0 else float("inf")
        than = f"{ratio:.2f}x sooner" if ratio >= 1 else f"{1 / ratio:.2f}x later"
        return f"reached eval_loss {target:.4g} in {self.seconds:.3g} s of steps, the exact layout in {exact_s:.3g} s ({than})"


def judge(exact: Curve, raced: list[Curve]) -> tuple[float, float, list[Verdict]]:
    """The target (the exact run's last eval loss), the exact layout's seconds to it, and each raced
    layout's verdict; at most one is chosen: the soonest, if :data:`RACE_MARGIN` sooner than exact.
    The curves hold finite losses only (the race leaves out a NaN evaluation)."""
    if not exact.points:
        raise ValueError("the exact layout's race run evaluated nothing finite")
    target = sorted(exact.points)[-1][1]
    exact_s = exact.seconds_to(target)
    assert exact_s is not None  # its own last point reaches it
    timed = [(curve, curve.seconds_to(target)) for curve in raced]
    winners = [(s, i) for i, (_, s) in enumerate(timed) if s is not None and s <= exact_s * (1 - RACE_MARGIN)]
    best = min(winners)[1] if winners else None
    return target, exact_s, [Verdict(curve, s, i == best) for i, (curve, s) in enumerate(timed)]
