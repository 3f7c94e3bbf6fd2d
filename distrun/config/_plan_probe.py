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
from typing import Any

from distrun.errors import ConfigError

__all__ = ["KEPT_LINK_KEYS", "PLAN_PROBE_MARK", "PLAN_PROBE_VAR", "PlanProbeSpec", "kept_links_valid"]

#: Set on every rank of a probe job: the PlanProbeSpec as JSON.
PLAN_PROBE_VAR = "DISTRUN_PLAN_PROBE"
#: What a probe's reply line starts with, the JSON after it (a cluster probe's rank 0 prints it among
#: the recipe's own output; the local probe too): never mistaken for a line the recipe printed.
PLAN_PROBE_MARK = "[distrun plan probe] "
#: What a cluster's kept links hold: the bytes they were timed on, the ring over every rank and the
#: link among one host's ranks (``{"bytes_per_s", "latency_s"}``, or None), FSDP's collectives' rates.
KEPT_LINK_KEYS = ("nbytes", "between_hosts", "within_host", "gather_bytes_per_s", "scatter_bytes_per_s")


def kept_links_valid(kept: Any) -> bool:
    """Whether ``kept`` is a cluster's kept links: the keys, numbers where numbers go."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0

    def link(value: Any) -> bool:  # a rate of 0 would divide by zero in the check
        return value is None or (isinstance(value, dict) and sorted(value) == ["bytes_per_s", "latency_s"]
                                 and all(number(v) for v in value.values()) and value["bytes_per_s"] > 0)
    return (isinstance(kept, dict) and sorted(kept) == sorted(KEPT_LINK_KEYS) and number(kept["nbytes"])
            and link(kept["between_hosts"]) and link(kept["within_host"])
            and number(kept["gather_bytes_per_s"]) and number(kept["scatter_bytes_per_s"]))


def _check_kept(kept: Any) -> None:
    """Kept links as the client sends them, else one line."""
    if not kept_links_valid(kept):
        raise ConfigError(f"{PLAN_PROBE_VAR}: kept_links is not a cluster's kept links; client and worker "
                          "versions differ?")


@dataclass(frozen=True)
class PlanProbeSpec:
    """``hosts`` worker hosts of ``ranks_per_host`` ranks each, consecutive ranks on one host."""

    hosts: int
    ranks_per_host: int
    #: The links this cluster's last probe measured (``KEPT_LINK_KEYS``), under a day old: the ranks
    #: check them with one all-reduce and time the collectives again only where they no longer hold.
    kept_links: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise ConfigError(f"{PLAN_PROBE_VAR}: hosts and ranks_per_host must be 1 or more. Received: "
                              f"{self.hosts}, {self.ranks_per_host}")
        if self.kept_links is not None:
            _check_kept(self.kept_links)

    def to_env(self) -> dict[str, str]:
        return {PLAN_PROBE_VAR: json.dumps({"hosts": self.hosts, "ranks_per_host": self.ranks_per_host,
                                            "kept_links": self.kept_links})}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PlanProbeSpec | None:
        """The job's PlanProbeSpec, or None in any other job."""
        text = environ.get(PLAN_PROBE_VAR)
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(hosts=int(data["hosts"]), ranks_per_host=int(data["ranks_per_host"]),
                       kept_links=data.get("kept_links"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{PLAN_PROBE_VAR}: not a probe spec ({exc}); client and worker versions differ?") from None
