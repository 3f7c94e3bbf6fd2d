"""``--strategy auto`` on a cluster: the probe job, followed quietly, and its figures made a plan.

The probe is the recipe shipped as any job is, as multi-worker over the hosts and slots the real
job gets (``runtime/_cluster_probe.py`` says what its ranks measure). Here the client follows it
without a live view, keeps the one line its rank 0 prints, and turns it into the same
:class:`~distrun.client.planning.Plan` a local probe gives: the resources are the cluster's (its
ranks over its hosts, the tightest rank's budget, the link among a host's ranks and the link the
ring between hosts took), and the cost model decides as it does here.
"""

from __future__ import annotations

import json
import time
from typing import Any

from distrun.client._bundle import Bundle
from distrun.client._job_env import JobEnvironment
from distrun.client.cluster_job import ClusterJob
from distrun.client.planning import Plan, follow_within
from distrun.config import PLAN_PROBE_MARK, JobSpec
from distrun.errors import RecipeError
from distrun.planner.choose import decide
from distrun.planner.cost import Link, ModelProfile, Resources
from distrun.protocol import Event, Output

__all__ = ["plan_on_cluster"]

#: The probe job's own limit, its links timed over slow ones included: a rank stuck longer is named.
PROBE_TIMEOUT_S = 300.0


def _probe(job: ClusterJob, spec: JobSpec, bundle: Bundle, environment: JobEnvironment | None) -> dict[str, Any]:
    """Run the probe job to its end; its rank 0's figures."""
    reply: dict[str, Any] | None = None
    with job:  # Ctrl-C or a failure here stops the probe on every host
        job.start(spec, bundle, environment=environment)

        def keep(event: Event | None) -> None:
            nonlocal reply
            if isinstance(event, Output) and event.rank == 0 and event.line.startswith(PLAN_PROBE_MARK):
                reply = json.loads(event.line[len(PLAN_PROBE_MARK):])

        if not follow_within(job, time.perf_counter() + PROBE_TIMEOUT_S, "--strategy auto: the probe ran past its limit",
                             keep):
            raise RecipeError(f"{spec.recipe}: --strategy auto's probe on the cluster took over "
                              f"{PROBE_TIMEOUT_S:.0f} s (build the model, two steps, the links); name a strategy")
        job.outcome()  # a failure is the recipe's, named as a training job's would be
    if reply is None:
        raise RecipeError(f"{spec.recipe}: --strategy auto's probe on the cluster ended without its figures")
    return reply


def plan_on_cluster(job: ClusterJob, spec: JobSpec, bundle: Bundle, environment: JobEnvironment | None, *,
                    kept_age_s: float | None = None) -> Plan:
    """Probe ``spec``'s recipe on the cluster ``job`` was planned on; decide its layout there.
    ``kept_age_s``: the age of the kept links the probe was sent (None: none were)."""
    started = time.perf_counter()
    reply = _probe(job, spec, bundle, environment)
    probe_s = time.perf_counter() - started

    def link(figures: dict[str, float] | None) -> Link | None:
        return Link(figures["bytes_per_s"], figures["latency_s"]) if figures else None

    hosts, per_host = int(reply["hosts"]), int(reply["ranks_per_host"])
    between = link(reply.get("between_hosts"))
    # One rank a host: nothing travels inside a host, and its "within" is never asked for.
    within = link(reply.get("within_host")) or between or Link(1e12, 0.0)
    resources = Resources(ranks=hosts * per_host, hosts=hosts, budget_bytes=int(reply["budget_bytes"]),
                          within_host=within, between_hosts=between if hosts > 1 else None, **reply["overheads"])
    batch = spec.training.global_batch_size or 32 * resources.ranks
    decision = decide(ModelProfile(**reply["profile"]), resources, batch)
    links = dict(reply["links"])
    if links["from"] == "kept":
        links["age_s"] = round(kept_age_s or 0.0, 1)
    return Plan(decision, resources, ModelProfile(**reply["profile"]), batch, time.perf_counter() - started, probe_s,
                str(reply["budget_source"]), links=links)
