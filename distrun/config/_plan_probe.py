"""``--strategy auto`` on a cluster: the probe job's part of a job spec.

Before a cluster job under auto, the client runs the recipe once as a probe job on the job's own
hosts and slots (multi-worker over every worker host), whose ranks measure the model, the memory
and the links instead of training (``runtime/_cluster_probe.py``). What they need beyond the
JobSpec crosses to every rank in one environment variable (the spec's ``extra_env``), as JSON, as
``distrun predict``'s does: how the ranks sit on the hosts, so that the ranks of one host can time
the links between them apart from the links between hosts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from distrun.errors import ConfigError

__all__ = ["PLAN_PROBE_MARK", "PLAN_PROBE_VAR", "PlanProbeSpec"]

#: Set on every rank of a probe job: the PlanProbeSpec as JSON.
PLAN_PROBE_VAR = "DISTRUN_PLAN_PROBE"
#: What a probe's reply line starts with, the JSON after it (a cluster probe's rank 0 prints it among
#: the recipe's own output; the local probe too): never mistaken for a line the recipe printed.
PLAN_PROBE_MARK = "[distrun plan probe] "


@dataclass(frozen=True)
class PlanProbeSpec:
    """``hosts`` worker hosts of ``ranks_per_host`` ranks each, consecutive ranks on one host."""

    hosts: int
    ranks_per_host: int

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise ConfigError(f"{PLAN_PROBE_VAR}: hosts and ranks_per_host must be 1 or more. Received: "
                              f"{self.hosts}, {self.ranks_per_host}")

    def to_env(self) -> dict[str, str]:
        return {PLAN_PROBE_VAR: json.dumps({"hosts": self.hosts, "ranks_per_host": self.ranks_per_host})}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PlanProbeSpec | None:
        """The job's PlanProbeSpec, or None in any other job."""
        text = environ.get(PLAN_PROBE_VAR)
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(hosts=int(data["hosts"]), ranks_per_host=int(data["ranks_per_host"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{PLAN_PROBE_VAR}: not a probe spec ({exc}); client and worker versions differ?") from None
