"""`distrun bench auto`: auto's pick against every kind of layout, run for real, in one run.

Each scenario is one model (the pipeline recipe at a width, depth and batch) and one memory
budget: memory to spare, or a v1 memory cgroup whose limit gives each rank 88% of the smallest
mirrored need the planner predicts (``distrun plan --json`` outside it), below it by more than
the model's error, so that no mirrored layout fits (the table shows whether mirrored ran anyway). In each,
the contenders are always-mirrored (``mirrored x2``), always-sharded (``sharded x2``), the
pipeline the planner ranks best, and ``--strategy auto`` itself; every one trains the same steps at
the same global batch, inside the scenario's cgroup (a run the kernel kills counts 0 samples/s).
The report gives each contender's samples/s, its predicted and measured peak (the highest rank's
VmHWM) and step time (the global batch over samples/s), auto's ratio to the best contender, to
always-mirrored and to always-sharded, and their geometric means. Never imports torch.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrun.bench._runs import HERE
from distrun.client.planning import measured_peak_mb
from distrun.errors import DistrunError

__all__ = ["SCENARIOS", "Scenario", "run_auto"]

_RECIPE = HERE / "_pipeline_recipe.py"
_CGROUPS = Path("/sys/fs/cgroup/memory")
#: The client beside the ranks in a scenario's cgroup (MB).
_CLIENT_MB = 100
_TIMEOUT_S = 900
#: A "below" scenario's share of mirrored's smallest predicted need that each rank gets.
_BELOW = 0.88
#: The issue's rule: a layout whose need is over this share of its budget is out.
_RULE = 0.9


@dataclass(frozen=True)
class Scenario:
    name: str
    args: tuple[str, ...]  # the recipe's
    batch: int
    below_mirrored: bool  # a cgroup below every mirrored layout's predicted need
    #: the run's steps, as a multiple of ``--steps``: a small model's step is milliseconds, and its
    #: samples/s (from the end of step 1 to the last) needs more of them to be more than noise.
    steps_factor: int = 1


_SMALL = ("--width", "8", "--layers", "2", "--samples", "1024")
_COMPUTE = ("--width", "512", "--layers", "8", "--samples", "4096")  # 17M parameters
_PARAMS = ("--width", "1024", "--layers", "4", "--samples", "512")  # 34M parameters
SCENARIOS = (
    Scenario("small model, memory to spare", _SMALL, 64, False, steps_factor=20),
    Scenario("17M params, batch 512, memory to spare", _COMPUTE, 512, False),
    Scenario("34M params, batch 8, memory to spare", _PARAMS, 8, False),
    Scenario("17M params, batch 512, a rank 88% of mirrored's predicted need", _COMPUTE, 512, True),
    Scenario("34M params, batch 8, a rank 88% of mirrored's predicted need", _PARAMS, 8, True),
)


def _distrun(argv: list[str], env: dict[str, str], cgroup: Path | None) -> tuple[int, list[dict[str, Any]], str]:
    command = [sys.executable, "-m", "distrun", *argv]
    if cgroup is not None:  # the client joins the cgroup first: the probe and the ranks are born in it
        command = ["sh", "-c", "echo $$ > \"$1\"/cgroup.procs && shift && exec \"$@\"", "sh", str(cgroup), *command]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=_TIMEOUT_S, check=False)  # noqa: S603
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, lines, proc.stderr


def _where(cluster: Path | None) -> list[str]:
    """This machine's CPU, or the cluster's hosts with their own devices."""
    return ["--cluster", str(cluster)] if cluster is not None else ["--device", "cpu"]


def _plan(scenario: Scenario, env: dict[str, str], cgroup: Path | None, cluster: Path | None) -> dict[str, Any]:
    code, lines, err = _distrun(["plan", str(_RECIPE), "--json", "--no-trials", *_where(cluster), "-b", str(scenario.batch),
                                 "--", *scenario.args], env, cgroup)
    if code != 0 or not lines:
        raise DistrunError(f"bench auto: distrun plan failed in {scenario.name!r}: "
                           + " | ".join(err.strip().splitlines()[-3:]))
    return lines[-1]


def _flags(flags: dict[str, Any], cluster: Path | None) -> list[str]:
    """``distrun train`` flags for a candidate, from its ``flags`` in the plan (``train``'s names);
    on a cluster each host runs its slots, so no ``--replicas``."""
    out = ["-s", str(flags["strategy"])] + (["--replicas", str(flags["replicas"])] if cluster is None else [])
    if int(flags.get("pp", 1)) > 1:
        out += ["--pp", str(flags["pp"]), "--pp-schedule", str(flags["pp_schedule"]),
                "--microbatches", str(flags["microbatches"])]
    if flags.get("activation_checkpointing", "none") != "none":
        out += ["--activation-checkpointing", str(flags["activation_checkpointing"])]
    if int(flags.get("accumulate", 1)) > 1:
        out += ["--accumulate", str(flags["accumulate"])]
    if flags.get("shard_within"):
        out += ["--shard-within", str(flags["shard_within"])]
    return out


def _train(scenario: Scenario, flags: list[str], steps: int, env: dict[str, str],
           cgroup: Path | None, cluster: Path | None) -> dict[str, Any]:
    if cgroup is not None:  # the cgroup's own peak, this run's alone
        (cgroup / "memory.max_usage_in_bytes").write_text("0")
    fetch = ["--no-fetch"] if cluster is not None else []
    code, lines, err = _distrun(["train", str(_RECIPE), *flags, *_where(cluster), *fetch, "--json", "--steps", str(steps),
                                 "-b", str(scenario.batch), "--", *scenario.args], env, cgroup)
    summary = next((line for line in reversed(lines) if line.get("type") == "summary"), {})
    rate = float(summary.get("samples_per_s") or 0.0) if code == 0 else 0.0
    return {"samples_per_s": rate, "peak_mb": measured_peak_mb(summary.get("peak_mem_mb")),
            "cgroup_peak_mb": _cgroup_peak_mb(cgroup),
            "step_s": scenario.batch / rate if rate > 0 else None, "exit": code, "plan": summary.get("plan"),
            "error": None if code == 0 else summary.get("error") or (err.strip().splitlines() or [""])[-1]}


def _contenders(plan: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(policy, candidate): always-mirrored (multi-worker on a cluster's hosts) and always-sharded
    over every rank, and the pipeline the planner ranks best (by predicted step among those that
    fit, else the first), each with its prediction."""
    def every_rank(names: tuple[str, ...]) -> dict[str, Any]:
        return max((c for c in plan["candidates"] if c["layout"].split(" x")[0] in names and " " not in
                    c["layout"].split(" x", 1)[1]), key=lambda c: int(c["flags"]["replicas"]))

    pipes = [c for c in plan["candidates"] if "--pp" in c["layout"]]
    fitting = [c for c in pipes if not c["verdict"].startswith("needs ")]
    best_pipe = min(fitting or pipes, key=lambda c: c["predicted_step_s"], default=None)
    out = [("mirrored", every_rank(("mirrored", "multi-worker"))), ("sharded", every_rank(("sharded",)))]
    if best_pipe is not None:
        out.append(("pipeline", best_pipe))
    return out


def _geomean(values: list[float]) -> float | None:
    if not values:
        return None
    if any(v <= 0 for v in values):
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _cgroup(name: str) -> Path:
    if not (_CGROUPS / "cgroup.procs").is_file() or os.geteuid() != 0:
        raise DistrunError("bench auto: the budget scenarios need root and the v1 memory controller at "
                           f"{_CGROUPS} (a cgroup per scenario)")
    group = _CGROUPS / name
    group.mkdir(exist_ok=True)
    return group


def _cgroup_peak_mb(group: Path | None) -> float | None:
    """The cgroup's peak charge since it was last reset (v1): what the kernel's limit is held to,
    which counts a page the ranks share once (their VmHWM each count it)."""
    if group is None:
        return None
    try:
        return round(int((group / "memory.max_usage_in_bytes").read_text()) / 10**6, 1)
    except (OSError, ValueError):
        return None


def _limit(group: Path, megabytes: float) -> None:
    for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
        if (group / name).is_file():
            (group / name).write_text(str(int(megabytes * 10**6)))


def run_auto(*, steps: int = 5, scenarios: tuple[Scenario, ...] | None = None, cluster: Path | None = None,
             progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The report: per scenario, each contender's figures and auto's ratios; their geometric means.
    ``cluster``: on that cluster's hosts and slots (after ``distrun up``), the memory-to-spare
    scenarios (a budget scenario's cgroup is this machine's), with the links between the hosts."""
    if scenarios is None:
        scenarios = SCENARIOS if cluster is None else tuple(s for s in SCENARIOS if not s.below_mirrored)
    if cluster is not None and any(s.below_mirrored for s in scenarios):
        raise DistrunError("bench auto --cluster: the budget scenarios put this machine's ranks in a memory cgroup; "
                           "on a cluster the hosts' own memory is the budget")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="distrun-bench-auto-") as home:
        # Locally no warm server: every rank is born in the scenario's cgroup. A cluster's servers are
        # the ones `distrun up` started, known to the user's own home.
        env = {**os.environ, "DISTRUN_HOME": home} if cluster is None else dict(os.environ)
        for index, scenario in enumerate(scenarios):
            group = limit_mb = None
            try:
                if scenario.below_mirrored:
                    outside = _plan(scenario, env, None, None)
                    need = min(c["predicted_peak_mb"] for c in outside["candidates"]
                               if c["layout"].startswith("mirrored x"))
                    group = _cgroup(f"distrun-bench-auto-{os.getpid()}-{index}")
                    # Below two mirrored ranks' smallest predicted need, by more than the model's error:
                    # mirrored does not fit, by the planner's 90% rule or the kernel's.
                    limit_mb = 2 * _BELOW * need + _CLIENT_MB
                    _limit(group, limit_mb)
                progress(f"{scenario.name}: planning")
                try:
                    plan = _plan(scenario, env, group, cluster)
                except DistrunError as exc:  # the probe itself did not fit: auto fails here (0 samples/s)
                    if not scenario.below_mirrored:
                        raise
                    plan = {**outside, "budget_mb": None, "plan_error": exc.message}
                contenders = []
                for policy, predicted in _contenders(plan):
                    progress(f"{scenario.name}: {predicted['layout']}")
                    run = _train(scenario, _flags(predicted["flags"], cluster), steps * scenario.steps_factor, env,
                                 group, cluster)
                    contenders.append({"layout": predicted["layout"], "policy": policy, **run,
                                       "predicted_peak_mb": predicted["predicted_peak_mb"],
                                       "predicted_step_s": predicted["predicted_step_s"]})
                progress(f"{scenario.name}: --strategy auto")
                auto = _train(scenario, ["-s", "auto"], steps * scenario.steps_factor, env, group, cluster)
                chosen = auto["plan"] or plan
                auto_row = {"layout": "auto: " + ("(failed)" if auto["exit"] else chosen["candidates"][0]["layout"]),
                            "policy": "auto", **auto, "predicted_peak_mb": chosen["predicted_peak_mb"],
                            "predicted_step_s": chosen["predicted_step_s"], "decide_s": chosen.get("decide_s")}
            finally:
                if group is not None:
                    group.rmdir()
            rows.append(_row(scenario, plan, [*contenders, auto_row], limit_mb))
    ok = [r for r in rows if r["vs_best"] is not None]  # a failed auto counts 0: its scenario stays in
    within = [r["vs_best_within_rule"] for r in rows if r["vs_best_within_rule"] is not None]
    return {"benchmark": "auto", "steps": steps, "cluster": str(cluster) if cluster else None, "rows": rows,
            "geomean_vs_best": _geomean([r["vs_best"] for r in ok]),
            "worst_vs_best": min((r["vs_best"] for r in ok), default=None),
            "geomean_vs_best_within_rule": _geomean(within), "worst_vs_best_within_rule": min(within, default=None),
            # The reading: each policy's samples/s over the scenarios, a failure counting 0, so a
            # policy that fails anywhere has a geometric mean of 0 and auto is ahead of it without bound.
            "geomean_vs_mirrored": _policy_ratio(rows, "mirrored"),
            "geomean_vs_sharded": _policy_ratio(rows, "sharded"),
            "mirrored_failed": sum(1 for r in rows if r["vs_mirrored"] is None),
            "sharded_failed": sum(1 for r in rows if r["vs_sharded"] is None)}


def _row(scenario: Scenario, plan: dict[str, Any], contenders: list[dict[str, Any]],
         limit_mb: float | None) -> dict[str, Any]:
    """A scenario's report: auto's ratio to the best contender (auto's pick is a candidate too), to
    each fixed policy, and to the best that kept the issue's rule (a layout whose need is over 90%
    of its budget is out): in a cgroup, a run whose cgroup peak went over 90% of the limit is
    shown, not counted best, as it ran on the kernel's edge (mirrored at 99% of it, once)."""
    rate = contenders[-1]["samples_per_s"]
    best = max(c["samples_per_s"] for c in contenders)
    for c in contenders:
        c["within_rule"] = c["exit"] == 0 and (limit_mb is None or (
            c["cgroup_peak_mb"] is not None and c["cgroup_peak_mb"] <= _RULE * limit_mb))
    kept = [c["samples_per_s"] for c in contenders if c["within_rule"]]
    mirrored, sharded = (next(c for c in contenders if c["policy"] == name)["samples_per_s"] for name in ("mirrored", "sharded"))
    return {"scenario": scenario.name, "budget_mb": plan.get("budget_mb"), "plan_error": plan.get("plan_error"),
            "cgroup_limit_mb": round(limit_mb, 1) if limit_mb is not None else None, "contenders": contenders,
            "vs_best": rate / best if best else None,
            "vs_best_within_rule": rate / max(kept) if kept and max(kept) > 0 else None,
            "vs_mirrored": rate / mirrored if mirrored else None,
            "vs_sharded": rate / sharded if sharded else None}


def _policy_ratio(rows: list[dict[str, Any]], name: str) -> float | None:
    """auto's geometric-mean samples/s over a fixed policy's; None where the policy failed somewhere
    (its mean is 0: auto is ahead of it without bound, and ``*_failed`` says in how many)."""
    auto = _geomean([r["contenders"][-1]["samples_per_s"] for r in rows])
    policy = _geomean([next(c for c in r["contenders"] if c["policy"] == name)["samples_per_s"] for r in rows])
    return auto / policy if auto is not None and policy else None
