"""``--strategy auto`` in the CLI: the layout chosen before the job is built, and said.

``train``, ``plan`` and ``--print-config`` share this: each asks :func:`choose` for the layout
of a recipe on this machine's ranks, which probes the recipe (client/planning.py), times the
layouts the model cannot tell apart (cli/_auto_trials.py), and returns the flags the choice sets,
the plan (None for a recipe the planner cannot probe), and the lines to print. A layout flag given beside ``auto`` is refused: auto chooses it, and a user who wants it
fixed names the strategy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrun.cli._auto_race import race
from distrun.cli._auto_trials import cluster_trial, run_local, time_near, trial_flags
from distrun.cli._spec import build_spec, local_layout, recipe_defaults, replicas_of
from distrun.cli.cluster import distrun_home
from distrun.client import ClusterJob, JobEnvironment, pack
from distrun.client._cluster_plan import plan_on_cluster
from distrun.client._link_cache import cluster_key, keep_links, kept_links
from distrun.client.planning import Plan, measured_peak_mb, plan_local
from distrun.config import ClusterSpec, JobSpec, PlanProbeSpec, RecipeInfo, RecipeKind, StrategyName, inspect_recipe
from distrun.errors import ConfigError, UsageError
from distrun.launch import visible_gpu_count
from distrun.planner.cost import Layout
from distrun.protocol import JobSummary

__all__ = ["AUTO", "Choice", "choose", "choose_on_cluster", "with_measured"]

AUTO = "auto"
#: The flags auto sets, with the value each has when nobody gave it.
_CHOSEN = {"tp": ("--tp", 1), "pp": ("--pp", 1), "microbatches": ("--microbatches", None),
           "pp_schedule": ("--pp-schedule", "1f1b"), "offload": ("--offload", "none"),
           "shard_within": ("--shard-within", "auto"),
           "activation_checkpointing": ("--activation-checkpointing", "none"), "accumulate": ("--accumulate", 1)}
#: What a trial takes from the command beyond the layout: what changes a step's time, so that a
#: trial times the job the user asked for.
TRIAL_KEEPS = ("precision", "compile", "compile_mode", "compression", "data_workers", "clip_grad_norm",
               "on_nonfinite")
#: What ``--auto-approximate`` checks a raced layout against beyond those: the flags of the job the
#: user asked for that an approximate layout may refuse (diloco: checkpoints at syncs, no
#: SyncBatchNorm, DDP's all-reduce only), so that no layout wins a race the job would then refuse.
JOB_CHECKS = ("steps", "epochs", "checkpoint_dir", "checkpoint_every", "sync_batch_norm", "allreduce", "embeddings")


@dataclass(frozen=True)
class Choice:
    """What auto set (``distrun train``'s parameter names), the plan behind it, the lines to say."""

    flags: dict[str, Any]
    plan: Plan | None
    lines: tuple[str, ...]


def _fit_recipe(recipe: Path, given: dict[str, Any] | None, *, approximate: bool = False,
                keep: dict[str, Any] | None = None, trials: bool = True) -> tuple[Path, RecipeInfo, str | None]:
    """The recipe's path and what it is; for a recipe the probe cannot lay out, why (else None)."""
    for name, (flag, unset) in _CHOSEN.items():
        value = (given or {}).get(name)
        if value not in (None, unset) and not (name == "microbatches" and value == 0):
            raise UsageError(f"--strategy auto chooses {flag} itself; drop {flag}, or name a strategy to pin a layout")
    if approximate and (keep or {}).get("compression", "none") not in (None, "none"):
        raise UsageError("--auto-approximate chooses --compression itself; drop --compression (or --auto-approximate)")
    if approximate and not trials:
        raise UsageError("--auto-approximate races the layouts it may choose; drop --no-trials")
    path = recipe.expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"{recipe}: recipe not found")
    info = inspect_recipe(str(path))
    if approximate and (info.kind is not RecipeKind.FIT or "eval_data" not in info.functions):
        raise UsageError(f"--auto-approximate: {recipe} has no eval_data(ctx): an approximate layout is judged by "
                         "the eval loss it reaches, so the recipe must evaluate (or drop --auto-approximate)")
    if info.kind is RecipeKind.FIT:
        return path, info, None
    return path, info, ("a plain script builds its own model and loop" if info.kind is RecipeKind.SCRIPT
                        else "a custom loop builds its model inside main(strategy), where the probe cannot reach it")


def choose(recipe: Path, *, replicas: int | None, device: str, global_batch_size: int | None, seed: int | None,
           recipe_args: tuple[str, ...] = (), given: dict[str, Any] | None = None, trials: bool = True,
           keep: dict[str, Any] | None = None, approximate: bool = False) -> Choice:
    """The layout of ``recipe`` on this machine; ``given``: the layout flags as the command has them;
    ``trials``: time the layouts the model cannot tell apart (``distrun plan --no-trials``: the model
    alone); ``keep``: the command's other flags a trial runs with (:data:`TRIAL_KEEPS`);
    ``approximate``: race compression and diloco against the exact choice (cli/_auto_race.py)."""
    path, info, unplanned = _fit_recipe(recipe, given, approximate=approximate, keep=keep, trials=trials)
    device, ranks = local_layout(device, replicas, visible_gpu_count())
    if unplanned is not None:
        return Choice({"strategy": "mirrored", "replicas": ranks, "device": device}, None,
                      (f"auto: {unplanned}, so it can only be placed, not laid out: mirrored x{ranks}",))
    filled = recipe_defaults(info, steps=None, epochs=None, global_batch_size=global_batch_size, seed=seed,
                             checkpoint_every=None)
    plan = plan_local(path, ranks=ranks, global_batch=int(filled["global_batch_size"]), seed=int(filled["seed"]),
                      device=device, args=recipe_args, evaluates="eval_data" in info.functions)
    notes: list[str] = []
    base = {**{name: value for name, value in (keep or {}).items() if name in TRIAL_KEEPS},
            "recipe": path, "recipe_args": recipe_args, "device": device, "global_batch_size": global_batch_size,
            "seed": seed}
    if trials:
        decision, spent_s = time_near(plan.decision, plan.decide_s,
                                      lambda layout, steps: build_spec(**trial_flags(base, layout, steps)), notes.append)
        plan = dataclasses.replace(plan, decision=decision, decide_s=plan.decide_s + spent_s)
    if approximate:
        plan = race(plan, lambda layout, steps, every: build_spec(**trial_flags(base, layout, steps)).replace(
            eval_every=every), run_local, **_job_limits(info, base, keep))
    flags = {**plan.decision.chosen.layout.flags(), "device": device}
    return Choice(flags, plan, (*notes, *plan.lines()))


def _job_limits(info: RecipeInfo, base: dict[str, Any], keep: dict[str, Any] | None) -> dict[str, Any]:
    """``race``'s ``check`` and ``sync_every_ok`` for the job the user asked for (:data:`JOB_CHECKS`):
    a raced layout must be one that job accepts, and diloco's interval must leave it 4 syncs and
    divide its checkpoint interval (checkpoints are written at syncs)."""
    job = {name: value for name, value in (keep or {}).items() if name in JOB_CHECKS and value is not None}

    def check(layout: Layout) -> str | None:
        try:
            build_spec(**{**base, "steps": None, "epochs": None, "checkpoint_dir": None, "checkpoint_every": None,
                          **job, **layout.flags()})
        except (ConfigError, UsageError) as exc:
            return exc.message.splitlines()[0] if exc.message else type(exc).__name__
        return None
    filled = recipe_defaults(info, steps=job.get("steps"), epochs=job.get("epochs"), global_batch_size=None,
                             seed=None, checkpoint_every=job.get("checkpoint_every"))
    steps, every = filled.get("steps"), job.get("checkpoint_every")

    def sync_every_ok(h: int) -> bool:
        return (not every or every % h == 0) and (not steps or 4 * h <= int(steps))
    return {"check": check, "sync_every_ok": sync_every_ok}


def with_measured(plan: Plan, summary: JobSummary) -> JobSummary:
    """The summary with its ``plan``: the prediction, and beside it the run's own figures (the highest
    rank's peak, and the global batch over samples/s as the step time)."""
    peak = measured_peak_mb(summary.peak_mem_mb)
    step_s = plan.global_batch / summary.samples_per_s if summary.samples_per_s > 0 else None
    return dataclasses.replace(summary, plan=plan.summary_object(peak, step_s))


def choose_on_cluster(cluster: ClusterSpec, recipe: Path, *, device: str, global_batch_size: int | None,
                      seed: int | None, recipe_args: tuple[str, ...] = (), include: list[Path] | None = None,
                      environment: JobEnvironment | None = None, given: dict[str, Any] | None = None,
                      trials: bool = True, keep: dict[str, Any] | None = None, approximate: bool = False) -> Choice:
    """The layout of ``recipe`` on ``cluster``'s worker hosts and slots, from a probe job run there
    (client/_cluster_plan.py), with the cluster's links kept from its last probe where they still
    hold (client/_link_cache.py); then, as here, the layouts the model cannot tell apart are timed,
    each a short cluster job of its own, while the decision stays within its budget."""
    path, info, unplanned = _fit_recipe(recipe, given, approximate=approximate, keep=keep, trials=trials)
    if unplanned is not None:
        return Choice({"strategy": "multi-worker", "replicas": None, "device": device}, None,
                      (f"auto: {unplanned}, so it can only be placed, not laid out: multi-worker",))
    job = ClusterJob.plan(cluster, StrategyName.MULTI_WORKER)
    try:
        slots = sorted({placement.slots for placement in job.placements})
        if len(slots) > 1:
            raise UsageError(f"--strategy auto: {cluster.source}'s worker hosts have {', '.join(map(str, slots))} "
                             "slots; the planner lays out hosts of equal slots (give each the same `slots:`)")
        if device == "auto":
            device = "cuda" if job.gpus_everywhere else "cpu"
        filled = recipe_defaults(info, steps=None, epochs=None, global_batch_size=global_batch_size, seed=seed,
                                 checkpoint_every=None)
        key = cluster_key([(p.host.label, p.host.address, p.slots) for p in job.placements],
                          cluster.network.interface, device)
        kept = kept_links(distrun_home(), key)
        probe = PlanProbeSpec(hosts=len(job.placements), ranks_per_host=slots[0],
                              kept_links=kept.figures if kept else None)
        spec = build_spec(recipe=path, recipe_args=recipe_args, strategy=StrategyName.MULTI_WORKER.value, device=device,
                          replicas=job.replicas, steps=1, epochs=None,
                          global_batch_size=int(filled["global_batch_size"]), seed=int(filled["seed"]),
                          checkpoint_dir=None, checkpoint_every=None, gpus=job.replicas if job.gpus_everywhere else 0,
                          extra_env=probe.to_env())
        bundle = pack(path, include or [])
    except BaseException:
        job.close()
        raise
    slots_total = job.replicas
    plan = plan_on_cluster(job, spec, bundle, environment, kept_age_s=kept.age_s() if kept else None)
    if plan.links is not None and plan.links["from"] == "timed":
        keep_links(distrun_home(), key, plan.links["figures"])
    notes: list[str] = []
    if trials:  # each a cluster job of its own, on the same hosts and slots, within the decision's budget
        base = {**{name: value for name, value in (keep or {}).items() if name in TRIAL_KEEPS},
                "recipe": path, "recipe_args": recipe_args, "device": device,
                "global_batch_size": int(filled["global_batch_size"]), "seed": seed,
                "gpus": slots_total if device == "cuda" else 0}

        def make_spec(layout: Layout, steps: int) -> JobSpec:
            flags = trial_flags(base, layout, steps)
            flags["replicas"] = replicas_of(slots_total, layout.tp * layout.pp, cluster.source)
            return build_spec(**flags)
        runner = cluster_trial(cluster, bundle, environment)
        decision, spent_s = time_near(plan.decision, plan.decide_s, make_spec, notes.append, run=runner)
        plan = dataclasses.replace(plan, decision=decision, decide_s=plan.decide_s + spent_s)
        if approximate:
            plan = race(plan, lambda layout, steps, every: make_spec(layout, steps).replace(eval_every=every), runner,
                        **_job_limits(info, base, keep))
    flags = {**plan.decision.chosen.layout.flags(), "replicas": None, "device": device}  # replicas: the slots
    return Choice(flags, plan, (*notes, *plan.lines()))
