"""``--strategy auto`` and ``distrun plan`` on this machine: probe, budget, decide, report.

The probe runs in its own process (``distrun.runtime.plan_probe``: torch never enters the
client), with the threads one rank of the job gets. The budget is each rank's share of what the
job may use: on a GPU the device's free memory (one GPU a rank); on CPU the memory cgroup this
command runs in (the ranks run inside it too, so they share its limit), else the host's
available memory, divided among the ranks. The link between local ranks is the loopback the
probe timed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import psutil

from distrun.config import PLAN_PROBE_MARK
from distrun.errors import RecipeError
from distrun.planner.choose import Decision, decide
from distrun.planner.cost import Link, ModelProfile, Resources
from distrun.planner.memory import cgroup_of
from distrun.protocol import Event

__all__ = ["Plan", "follow_within", "measured_peak_mb", "memory_budget", "plan_local"]

#: The probe's own limit: a recipe whose model takes longer than this to build and step twice
#: is named, not waited for.
PROBE_TIMEOUT_S = 120.0
MB = 1e6
#: The ranks' unit of memory (a summary's ``peak_mem_mb``: CUDA's max allocated, or VmHWM).
MIB = 2**20


def measured_peak_mb(peak_mem_mib: dict[str, float] | None) -> float | None:
    """The highest rank's peak of a summary's ``peak_mem_mb`` (MiB, as the ranks count), in the
    planner's MB (10**6 bytes), so that it stands beside a prediction: it read 4.9% low as MiB."""
    return max(peak_mem_mib.values()) * MIB / MB if peak_mem_mib else None


@dataclass(frozen=True)
class Plan:
    """A decision and what it took to reach it."""

    decision: Decision
    resources: Resources
    profile: ModelProfile
    global_batch: int
    decide_s: float
    probe_s: float
    budget_source: str  # "cgroup memory.limit_in_bytes", "MemAvailable", "GPU free memory"
    #: A cluster's links: ``{"from": "kept" | "timed", "why", "figures", "age_s" (kept)}``; None here.
    links: dict[str, Any] | None = None
    #: ``--auto-approximate``'s race (cli/_auto_race.py): ``{"raced", "said" (the lines printed), and, where
    #: it ran, "metric", "target", "exact", "exact_s"}``; None without the option.
    race: dict[str, Any] | None = None

    def lines(self) -> list[str]:
        """The block printed before step 1: the choice, its prediction, up to three runners-up."""
        chosen = self.decision.chosen
        step = f"{chosen.step_s:.3g} s/step" if chosen.timed_step_s is None else \
            f"{chosen.timed_step_s:.3g} s/step timed (the model said {chosen.step_s:.3g})"
        out = [f"auto: {chosen.layout.describe()}: predicted peak {chosen.peak_bytes / MB:,.0f} MB a rank "
               f"(budget {self.resources.budget_bytes / MB:,.0f} MB, {self.budget_source}), "
               f"{step}; decided in {self.decide_s:.1f} s"]
        for prediction, verdict in self.decision.runners_up():
            out.append(f"  not {prediction.layout.describe()}: {verdict}")
        if self.links is not None:
            out.append(f"  links: {_links_said(self.links)}")
        if self.race is not None:
            out.extend(self.race["said"])
        return out

    def summary_object(self, measured_peak_mb: float | None, measured_step_s: float | None) -> dict[str, Any]:
        """The ``--json`` summary's ``plan``: the chosen layout in the job file's keys, and every
        candidate's prediction and verdict; the run's own figures beside them."""
        chosen = self.decision.chosen
        return {
            "chosen": chosen.layout.job_file(),
            "predicted_peak_mb": round(chosen.peak_bytes / MB, 1),
            "predicted_step_s": chosen.expected_step_s,
            "model_step_s": chosen.step_s,  # the cost model's, where a trial's time is the prediction
            "timed": chosen.timed_step_s is not None,
            "decide_s": round(self.decide_s, 3),
            "probe_s": round(self.probe_s, 3),
            "budget_mb": round(self.resources.budget_bytes / MB, 1),
            "candidates": [{"layout": p.layout.describe(), "predicted_peak_mb": round(p.peak_bytes / MB, 1),
                            "predicted_step_s": p.step_s, "timed_step_s": p.timed_step_s, "verdict": verdict,
                            "flags": p.layout.flags(),
                            # the step's parts: the arithmetic, the links' exposed time, the machinery's own
                            "step_parts_s": {"compute": p.compute_s, "comm": p.exposed_comm_s, "fixed": p.fixed_s},
                            "memory_parts_mb": {name: round(size / MB, 1) for name, size in p.parts.items()}}
                           for p, verdict in self.decision.ranked],
            # What the model was given, measured: the recipe's model (bytes, seconds a sample) and the
            # job's ranks, budget and links; each figure a candidate's prediction is made of.
            "inputs": {"profile": dataclasses.asdict(self.profile), "resources": dataclasses.asdict(self.resources)},
            "measured_peak_mb": measured_peak_mb,
            "measured_step_s": measured_step_s,
            **({"links": {k: v for k, v in self.links.items() if k != "figures"}} if self.links else {}),
            **({"race": self.race} if self.race is not None else {}),
        }


def _links_said(links: dict[str, Any]) -> str:
    """``kept from 2.0 h ago (a 1,048,576-byte all-reduce took 1.1x what they say)`` or ``timed now``."""
    if links["from"] == "kept":
        return f"kept from {links['age_s'] / 3600:.1f} h ago ({links['why']})"
    return "timed now, kept for a day" + (f" ({links['why']})" if links.get("why") else "")


def follow_within(job: Any, deadline: float, reason: str,
                  on_event: Callable[[Event | None], None] = lambda _: None) -> bool:
    """Follow ``job`` (local or cluster: its ``events()`` and ``cancel()``) to its end, handing each
    event to ``on_event``; past ``deadline`` (a ``time.perf_counter()``) cancel it for ``reason``,
    wait for it to stop, and return False. The planner's probe and trials run under it: a decision
    that waits has a limit."""
    for event in job.events():  # None every quarter second: the clock is read even when nothing comes
        on_event(event)
        if time.perf_counter() > deadline:
            job.cancel(reason)
            for _ in job.events():
                pass
            return False
    return True


def memory_budget(ranks: int, device: str, device_free_bytes: int | None) -> tuple[int, str]:
    """One rank's budget in bytes, and where it came from."""
    if device == "cuda" and device_free_bytes:
        return int(device_free_bytes), "GPU free memory"
    group = cgroup_of(os.getpid())
    limit = group.limit_bytes() if group is not None else None
    if limit is not None:  # this command stays in it beside the ranks: what it holds is not theirs
        mine = psutil.Process().memory_info().rss
        return (limit - mine) // ranks, f"memory cgroup {group.name}'s limit less this command, " \
            f"shared by {ranks} rank(s)"
    available = psutil.virtual_memory().available  # Linux's MemAvailable
    return available // ranks, f"MemAvailable, shared by {ranks} rank(s)"


def _run_probe(request: dict[str, Any], recipe: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "distrun.runtime.plan_probe", json.dumps(request)]
    env = {**os.environ, "OMP_NUM_THREADS": str(request["threads"])}
    # Its own session: on a timeout, the probe's processes go together (its peers are its forks).
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RecipeError(f"{recipe}: --strategy auto's probe (build the model, two steps) took over "
                          f"{PROBE_TIMEOUT_S:.0f} s") from None
    except BaseException:  # Ctrl-C: nothing of the probe outlives the command
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    done = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    lines = [line[len(PLAN_PROBE_MARK):] for line in done.stdout.splitlines() if line.startswith(PLAN_PROBE_MARK)]
    reply = json.loads(lines[-1]) if lines else None
    killed = -done.returncode if reply is None and done.returncode < 0 else (reply or {}).get("killed_signal")
    if killed:  # one of its processes killed (the first's watchers name a peer's death)
        raise RecipeError(f"{recipe}: --strategy auto's probe was killed by signal {killed}"
                          f"{' (the out-of-memory killer?)' if killed == 9 else ''}: each of its "
                          f"{request['ranks_here']} process(es) holds the whole model and its gradients; "
                          "give the job more memory, or name a strategy", detail=done.stderr)
    if reply is None:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RecipeError(f"{recipe}: --strategy auto's probe failed: {last}", detail=done.stderr)
    if "error" in reply:
        where = f"{reply['location'][0]}:{reply['location'][1]}: " if reply.get("location") else f"{recipe}: "
        raise RecipeError(f"{where}the probe of --strategy auto failed building or stepping the model: "
                          f"{reply['error']}", detail=reply.get("detail"))
    return reply


def plan_local(recipe: Path, *, ranks: int, global_batch: int, seed: int, device: str,
               args: tuple[str, ...] = (), evaluates: bool = False) -> Plan:
    """Probe ``recipe`` here and decide its layout over ``ranks`` local ranks at ``global_batch``."""
    started = time.perf_counter()
    threads = max(1, (os.cpu_count() or 1) // ranks) if device != "cuda" else max(1, os.cpu_count() or 1)
    request = {"recipe": str(recipe), "args": list(args), "global_batch_size": global_batch,
               "rows": max(1, global_batch // ranks), "seed": seed, "threads": threads,
               "ranks_here": ranks if device != "cuda" else 1, "evaluates": evaluates,
               "device": "cuda" if device == "cuda" else "cpu",
               "tp_up_to": ranks}  # one probe process on a GPU host still measures what --tp would split
    if device != "cuda":  # a probe process measures within a rank's budget (a GPU's is read on the GPU)
        request["memory_cap_bytes"] = memory_budget(ranks, device, None)[0]
    reply = _run_probe(request, recipe)
    profile = ModelProfile(**reply["profile"])
    budget, source = memory_budget(ranks, device, reply.get("device_free_bytes"))
    link = Link(reply["link"]["bytes_per_s"], reply["link"]["latency_s"])
    # --offload cpu keeps a rank's shards in host memory: its share of the host's (a GPU host's only).
    host_budget = memory_budget(ranks, "cpu", None)[0] if device == "cuda" else 0
    resources = Resources(ranks=ranks, hosts=1, budget_bytes=budget, within_host=link, host_budget_bytes=host_budget,
                          **reply.get("overheads", {}))
    decision = decide(profile, resources, global_batch)
    return Plan(decision, resources, profile, global_batch, time.perf_counter() - started,
                float(reply.get("probe_s", 0.0)), source)
