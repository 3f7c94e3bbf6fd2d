"""From measured inputs to one layout: the candidates, their predictions, the choice and why.

The candidates are the exact layouts the job's ranks allow (each ends with one-device's
parameters): mirrored (multi-worker over several hosts), sharded (and HSDP over several hosts of
several ranks), ``--pp p`` for every ``p`` that divides the ranks and the recipe's ``pp_chain``
can take, on GPUs ``--tp t`` for every ``t`` the model's plan takes that divides a host's ranks and
sharded ``--offload cpu`` (one GPU included), each with and without full
activation checkpointing, and each with the ``--accumulate`` counts the global batch divides
into. The global batch never changes.

A candidate whose predicted peak passes 90% of the budget is out. Of the rest the fastest
predicted step wins; a prediction within :data:`NEAR` of the fastest loses to the simpler
layout (fewer moving parts: no pipeline, no checkpointing, no accumulation, no sharding, fewer
microbatches), because the model's error is larger than that gap. Where the CLI can, it then runs the near
ones for a few steps (cli/_auto_trials.py) and :func:`retime` keeps the faster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from distrun.errors import ConfigError
from distrun.planner.cost import BUDGET_SHARE, Layout, ModelProfile, Prediction, Resources, fits, predict

__all__ = ["Decision", "NEAR", "candidates", "decide", "retime"]

#: Two predictions closer than this share are a tie, which the simpler layout takes: the issue's
#: 15%, within which the model cannot tell two layouts apart (the CLI then times them: see
#: :func:`retime`).
NEAR = 0.15
#: Why ``--tp`` is no candidate on CPU: gloo all-reduces every split layer's activations inside the
#: step and DTensor dispatches each op; on this project's 2-core host, an 8.5M-parameter MLP at batch
#: 512 ran ``mirrored --tp 2`` at 0.39 s/step and mirrored x2 at 0.30 (12 steps each), where the
#: model, with DTensor's measured cost a layer pair, put them at 0.28 and 0.46: the order reversed
#: (an auto trial of the first, under load, took 0.64). On a GPU its all-reduces go over
#: NVLink or PCIe under NCCL; there it is a candidate, and, its model unchecked on GPUs, it is
#: chosen only on a trial's time (:func:`decide`, cli/_auto_trials.py), never on the model's word.
TP_ON_CPU = "--tp is no candidate on CPU (gloo's all-reduce of every split layer's activations)"
#: --accumulate counts searched (each must divide a replica's batch).
ACCUMULATE = (1, 2, 4, 8, 16)
MB = 1e6


@dataclass(frozen=True)
class Decision:
    """The chosen layout's prediction, and every candidate's, best first, with its verdict."""

    chosen: Prediction
    ranked: tuple[tuple[Prediction, str], ...]  # (prediction, verdict), the chosen one first
    budget_mb: float = 0.0  # a rank's, as the verdicts say it

    def runners_up(self, count: int = 3) -> list[tuple[Prediction, str]]:
        """The best of each other kind of exact layout (strategy and pipeline depth), best first: what
        the choice is said against (its own variants would only repeat it; ``--auto-approximate``'s
        raced layouts are said by the race's own lines)."""
        seen = {self.chosen.layout.kind}
        picked = []
        for prediction, verdict in self.ranked[1:]:
            if prediction.layout.exact and prediction.layout.kind not in seen:
                seen.add(prediction.layout.kind)
                picked.append((prediction, verdict))
        return picked[:count]


def _simplicity(layout: Layout) -> tuple[int, int, int, int, int, int]:
    """Fewer moving parts first. Of two pipelines alike but for their microbatches, the fewer: each
    microbatch pays a fixed part whose probe reading is the model's noisiest input, low more often
    than high on this project's machine (docs/performance.md#strategy-auto), and measured there,
    2 microbatches of the 34M-parameter MLP ran at 0.97 s a step where 8 took 1.38."""
    return (layout.pp, layout.tp + int(layout.offload), int(layout.activation_checkpointing != "none"), layout.accumulate,
            int(layout.strategy == "sharded"), layout.microbatches)


def candidates(profile: ModelProfile, resources: Resources, global_batch: int) -> list[Layout]:
    """Every exact layout of the job's ranks that the batch and the recipe allow."""
    ranks = resources.ranks
    data_parallel = "multi-worker" if resources.hosts > 1 else "mirrored" if ranks > 1 else "one-device"
    offloads = (False, True) if profile.device == "cuda" and profile.optimizer_cpu_s > 0 else (False,)  # GPUs only
    shapes: list[tuple[str, int, int, int, int]] = [(data_parallel, ranks, 1, 0, 1)]
    if ranks > 1 or True in offloads:  # one GPU: sharded x1 only as --offload's host
        shapes.append(("sharded", ranks, 1, 0, 1))
    hsdp = resources.hosts > 1 and resources.ranks_per_host > 1 and ranks % resources.hosts == 0
    for pp in range(2, ranks + 1):
        if ranks % pp == 0 and 0 < profile.chain_parts and pp <= profile.chain_parts:
            for m in (pp, 2 * pp, 4 * pp):
                shapes.append((data_parallel, ranks // pp, pp, m, 1))
    for tp in profile.tp_degrees if profile.device == "cuda" else ():  # see TP_ON_CPU
        if resources.ranks_per_host % tp == 0 and ranks % tp == 0:  # a tensor-parallel group in one host
            shapes.append((data_parallel if ranks > tp else "mirrored", ranks // tp, 1, 0, tp))
    out = []
    for strategy, replicas, pp, m, tp in shapes:
        for checkpointing in ("none", "full"):
            for accumulate in ACCUMULATE:
                if global_batch % (replicas * accumulate):
                    continue
                rows = global_batch // replicas // accumulate
                if pp > 1 and rows % m:
                    continue
                if not (strategy == "sharded" and ranks == 1):  # sharded x1 is only --offload's
                    out.append(Layout(strategy, replicas, pp=pp, microbatches=m if pp > 1 else 0,
                                      activation_checkpointing=checkpointing, accumulate=accumulate, tp=tp))
                if strategy == "sharded" and hsdp:
                    out.append(Layout(strategy, replicas, activation_checkpointing=checkpointing,
                                      accumulate=accumulate, shard_within="host"))
                if strategy == "sharded" and True in offloads:
                    out.append(Layout(strategy, replicas, activation_checkpointing=checkpointing,
                                      accumulate=accumulate, offload=True))
    return out


def _why_slower(prediction: Prediction, best: Prediction) -> str:
    if prediction.timed_step_s is not None and best.timed_step_s is not None:
        slower = prediction.timed_step_s / best.timed_step_s - 1 if best.timed_step_s > 0 else 0.0
        # A trial times the whole step; where its time goes is the model's to say.
        return (f"timed at {prediction.timed_step_s:.3g} s/step, {slower:.0%} slower "
                f"({_cause(prediction)}, by the model)")
    slower = prediction.step_s / best.step_s - 1 if best.step_s > 0 else 0.0
    if best.timed_step_s is not None and slower < 0.005:  # the model liked it, the trials did not reach it
        return f"{prediction.step_s:.3g} s/step by the model, not timed"
    if not prediction.layout.trusted and slower < 0.005:
        flag = "--tp" if prediction.layout.tp > 1 else "--offload"
        return f"{prediction.step_s:.3g} s/step by the model, not timed: {flag} is chosen on a trial's time only"
    return f"{prediction.step_s:.3g} s/step, {slower:.0%} slower ({_cause(prediction)})" if slower >= 0.005 else \
        f"{prediction.step_s:.3g} s/step, as fast; the chosen one is simpler"


def _cause(prediction: Prediction) -> str:
    """What costs a layout its time, by the cost model's parts of its step."""
    if prediction.comm_share >= 0.5:
        return f"{prediction.comm_share:.0%} waiting on the links"
    if prediction.fixed_s >= 0.5 * prediction.step_s:
        return f"{prediction.fixed_s / prediction.step_s:.0%} the layout's own fixed costs"
    if prediction.layout.pp > 1:
        return "the pipeline's bubble and activation hops"
    if prediction.layout.activation_checkpointing != "none":
        return "recomputes the forward"
    if prediction.layout.accumulate > 1:
        return f"{prediction.layout.accumulate} forwards a step"
    return f"{prediction.comm_share:.0%} waiting on the links"


def decide(profile: ModelProfile, resources: Resources, global_batch: int) -> Decision:
    """The fastest layout that fits, and every other one's verdict; none fits: ConfigError (exit 2)
    naming the smallest need against the budget."""
    predictions = [predict(profile, resources, layout, global_batch)
                   for layout in candidates(profile, resources, global_batch)]
    if not predictions:
        raise ConfigError(f"--strategy auto: no layout of {resources.ranks} rank(s) divides the global batch "
                          f"of {global_batch}")
    fitting = [p for p in predictions if fits(p, resources)]
    budget_mb = resources.budget_bytes / MB
    if not fitting:
        smallest = min(predictions, key=lambda p: p.peak_bytes)
        raise ConfigError(f"--strategy auto: no layout fits: the smallest, {smallest.layout.describe()}, needs "
                          f"{smallest.peak_bytes / MB:,.0f} MB a rank; the budget is {budget_mb:,.0f} MB "
                          f"({BUDGET_SHARE:.0%} of it usable)")
    # --tp and --offload are chosen on a trial's time only (see TP_ON_CPU), unless nothing else fits.
    trusted = [p for p in fitting if p.layout.trusted] or fitting
    fastest = min(p.step_s for p in trusted)
    near = [p for p in trusted if p.step_s <= fastest * (1 + NEAR)]
    chosen = min(near, key=lambda p: (_simplicity(p.layout), p.step_s))
    return _ranked(chosen, predictions, [fits(p, resources) for p in predictions], budget_mb)


def _ranked(chosen: Prediction, predictions: list[Prediction], fitting: list[bool], budget_mb: float) -> Decision:
    """The decision with ``chosen`` first and every other prediction's verdict, fitting ones first."""
    ranked: list[tuple[Prediction, str]] = [(chosen, "chosen")]
    rest = sorted((pair for pair in zip(predictions, fitting) if pair[0] is not chosen),
                  key=lambda pair: (not pair[1], pair[0].timed_step_s is None, pair[0].expected_step_s))
    for prediction, fit in rest:
        if not fit and prediction.host_bytes and prediction.peak_bytes <= BUDGET_SHARE * budget_mb * MB:
            verdict = (f"needs {prediction.host_bytes / MB:,.0f} MB of its host's memory for the offloaded "
                       f"state, over its share of the host")
        elif not fit:
            # Said against what is usable, not the whole budget: "needs 1,093 MB, the budget is 1,117 MB"
            # read as if it fitted.
            verdict = (f"needs {prediction.peak_bytes / MB:,.0f} MB a rank, over the {BUDGET_SHARE * budget_mb:,.0f} MB "
                       f"usable of a {budget_mb:,.0f} MB budget")
        else:
            verdict = _why_slower(prediction, chosen)
        ranked.append((prediction, verdict))
    return Decision(chosen, tuple(ranked), budget_mb)


def retime(decision: Decision, timed: dict[Layout, float], failed: dict[Layout, str] | None = None) -> Decision:
    """The decision once some fitting layouts were run for a few steps (``timed``: layout -> seconds
    a step; ``failed``: layout -> why its run failed). The fastest timed one is chosen, its time the
    step the plan predicts; a failed layout is out with every variant of its kind (``Layout.kind``:
    the same machinery), and without a timed one the model's fastest of the rest is
    chosen. Nothing left: ConfigError (exit 2). The untimed keep the model's verdicts."""
    failed = failed or {}
    failed_kinds = {layout.kind: why for layout, why in failed.items()}
    predictions = [replace(p, timed_step_s=timed.get(p.layout)) for p, _ in decision.ranked]
    fitting = [not verdict.startswith("needs ") and p.layout.kind not in failed_kinds for p, verdict in decision.ranked]
    timed_ones = [p for p in predictions if p.timed_step_s is not None]
    left = [p for p, fit in zip(predictions, fitting) if fit]
    if not left:
        raise ConfigError("--strategy auto: no layout fits: every one the model said fits failed in its trial ("
                          + "; ".join(f"{layout.describe()}: {why}" for layout, why in failed.items()) + ")")
    trusted = [p for p in left if p.layout.trusted] or left  # --tp, --offload: on a trial's time only
    chosen = min(timed_ones, key=lambda p: p.expected_step_s) if timed_ones else min(trusted, key=lambda p: p.step_s)
    ranked = _ranked(chosen, predictions, fitting, decision.budget_mb)
    over_budget = {p.layout for p, verdict in decision.ranked if verdict.startswith("needs ")}

    def verdict_of(prediction: Prediction, verdict: str) -> str:
        why = failed_kinds.get(prediction.layout.kind)
        return f"failed in its trial: {why}" if why is not None and prediction.layout not in over_budget else verdict
    return Decision(chosen, tuple((p, verdict_of(p, verdict)) for p, verdict in ranked.ranked), decision.budget_mb)
