"""Each host's CPU, memory and GPU use over time, for the hosts page's charts.

A worker server answers ``status`` with the moment's readings only, and keeps no history (it
would cost every host memory and a clock for a page nobody may open). The dashboard keeps what
it was told, per host, for as long as it runs: a ring of :data:`KEEP_SAMPLES`, recorded whenever
the hosts are asked (the page asks every 5 s) and, with no page open, by the dashboard's own
sampler every :data:`SAMPLE_EVERY_S`. So a page opened late still shows the last hour, as
Ray's and SkyPilot's node views do, without Prometheus.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["HostHistory", "KEEP_SAMPLES", "SAMPLE_EVERY_S", "Sample"]

#: The sampler's period with no page asking, and the ring's length: an hour at that period.
SAMPLE_EVERY_S = 10.0
KEEP_SAMPLES = 360
#: Answers closer than this to the host's last sample are not recorded again (two open pages, or a
#: page and the sampler, would otherwise double the points without adding news).
MIN_GAP_S = 1.0


@dataclass(frozen=True)
class Sample:
    """One host at one moment: percentages, None where the server did not say (an older server's
    CPU, a host with no GPU). GPUs are averaged over the host's devices (the panel beside the
    chart shows each)."""

    time: float  # Unix time, as the page labels its axis
    cpu_pct: float | None
    memory_pct: float | None
    gpu_util_pct: float | None
    gpu_memory_pct: float | None


def sample_of(server: dict[str, Any] | None, now: float) -> Sample | None:
    """The readings in one host row's ``server`` (``distrun status --json``); None for a host
    whose server did not answer (a gap in its chart, not a zero)."""
    if not server:
        return None
    total = server.get("memory_total_bytes") or 0
    memory_pct = 100.0 * (total - server["memory_available_bytes"]) / total if total else None
    gpus = server.get("gpus") or []
    util = sum(gpu["util_pct"] for gpu in gpus) / len(gpus) if gpus else None
    gpu_memory = (100.0 * sum(gpu["memory_used_bytes"] for gpu in gpus) / sum(gpu["memory_total_bytes"] for gpu in gpus)
                  if gpus and sum(gpu["memory_total_bytes"] for gpu in gpus) else None)
    cpu = server.get("cpu_pct")
    return Sample(now, None if cpu is None else float(cpu), memory_pct, util, gpu_memory)


class HostHistory:
    """Per (cluster, host), the newest :data:`KEEP_SAMPLES` samples; thread-safe (the request
    threads and the sampler record into it)."""

    def __init__(self, keep: int = KEEP_SAMPLES) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._samples: dict[tuple[str, str], deque[Sample]] = {}
        self._last_recorded = 0.0  # monotonic

    def record(self, rows: list[dict[str, Any]]) -> None:
        """Each row of ``Sources.hosts()`` that has a server's answer, as of now."""
        now = time.time()
        with self._lock:
            self._last_recorded = time.monotonic()
            for row in rows:
                sample = sample_of(row.get("server"), now)
                if sample is None:
                    continue
                ring = self._samples.setdefault((row.get("cluster", ""), row["host"]), deque(maxlen=self._keep))
                if ring and now - ring[-1].time < MIN_GAP_S:
                    continue
                ring.append(sample)

    def idle_s(self) -> float:
        """Seconds since anything was recorded: the sampler asks only when the page has not."""
        with self._lock:
            return time.monotonic() - self._last_recorded

    def of(self, cluster: str, host: str) -> list[dict[str, Any]]:
        with self._lock:
            return [asdict(sample) for sample in self._samples.get((cluster, host), ())]

    def with_history(self, answer: dict[str, Any]) -> dict[str, Any]:
        """``Sources.hosts()``'s answer with each row's ``history``, oldest first."""
        return {**answer, "hosts": [{**row, "history": self.of(row.get("cluster", ""), row["host"])}
                                    for row in answer["hosts"]]}
