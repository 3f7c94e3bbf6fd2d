"""Each host's CPU, memory and GPU use over time, for the hosts page's charts.

A worker server answers ``status`` with the moment's readings only, and keeps no history (it
would cost every host memory and a clock for a page nobody may open). The dashboard keeps what
it was told, per host, for the last :data:`HISTORY_S`: recorded whenever the hosts are asked (an
open page asks every 5 s) and, with no page open, by the dashboard's own sampler every
:data:`SAMPLE_EVERY_S` (one ``status`` per host, as ``distrun status`` asks). So a page opened
late still shows the last hour, as Ray's and SkyPilot's node views do, without Prometheus.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["HISTORY_S", "HostHistory", "SAMPLE_EVERY_S", "Sample", "sample_of"]

#: How far back the charts go, and the sampler's period when no page asks.
HISTORY_S = 3600.0
SAMPLE_EVERY_S = 30.0
#: An answer closer than this to the host's last sample is not recorded again (two open pages, or a
#: page and the sampler, would double the points without adding news).
MIN_GAP_S = 1.0
#: At most this many samples a host: an hour at one page's 5 s (several pages open fill it sooner,
#: down to MIN_GAP_S apart).
KEEP_SAMPLES = 720


@dataclass(frozen=True)
class Sample:
    """One host at one moment: percentages to a tenth, None where nothing was said (an older
    server's CPU, a host with no GPU, and every figure of a host that did not answer: a gap in
    its charts, never a zero). GPUs are averaged over the host's devices (the panel beside the
    charts shows each)."""

    time: float  # Unix time, as the page labels its axis
    cpu_pct: float | None
    memory_pct: float | None
    gpu_util_pct: float | None
    gpu_memory_pct: float | None


def _pct(part: float, whole: float) -> float | None:
    return round(100.0 * part / whole, 1) if whole else None


def sample_of(server: dict[str, Any] | None, now: float) -> Sample:
    """The readings in one host row's ``server`` (``distrun status --json``); all None for a host
    whose server did not answer."""
    if not server:
        return Sample(now, None, None, None, None)
    total = server.get("memory_total_bytes") or 0
    gpus = server.get("gpus") or []
    cpu = server.get("cpu_pct")
    return Sample(now, None if cpu is None else round(float(cpu), 1),
                  _pct(total - server["memory_available_bytes"], total),
                  round(sum(gpu["util_pct"] for gpu in gpus) / len(gpus), 1) if gpus else None,
                  _pct(sum(gpu["memory_used_bytes"] for gpu in gpus), sum(gpu["memory_total_bytes"] for gpu in gpus)))


class HostHistory:
    """Per (cluster, host), the samples of the last :data:`HISTORY_S`; thread-safe (the request
    threads and the sampler record into it)."""

    def __init__(self, keep: int = KEEP_SAMPLES, history_s: float = HISTORY_S) -> None:
        self._keep = keep
        self._history_s = history_s
        self._lock = threading.Lock()
        self._samples: dict[tuple[str, str], deque[Sample]] = {}
        self._last_at: dict[tuple[str, str], float] = {}  # monotonic: a wall clock stepped back drops nothing
        self._last_recorded = 0.0  # monotonic

    def record(self, rows: list[dict[str, Any]]) -> None:
        """Each row of ``Sources.hosts()``, as of now; hosts not heard of for the whole history
        (a Slurm allocation's nodes, long gone) are forgotten."""
        now, at = time.time(), time.monotonic()
        with self._lock:
            self._last_recorded = at
            for row in rows:
                key = (row.get("cluster", ""), row["host"])
                if at - self._last_at.get(key, -MIN_GAP_S) < MIN_GAP_S:
                    continue
                self._last_at[key] = at
                self._samples.setdefault(key, deque(maxlen=self._keep)).append(sample_of(row.get("server"), now))
            for key, ring in list(self._samples.items()):
                while ring and now - ring[0].time > self._history_s:
                    ring.popleft()
                if not ring:
                    del self._samples[key], self._last_at[key]

    def idle_s(self) -> float:
        """Seconds since anything was recorded: the sampler asks only when no page has."""
        with self._lock:
            return time.monotonic() - self._last_recorded

    def of(self, cluster: str, host: str) -> list[dict[str, Any]]:
        with self._lock:
            return [asdict(sample) for sample in self._samples.get((cluster, host), ())]

    def with_history(self, answer: dict[str, Any]) -> dict[str, Any]:
        """``Sources.hosts()``'s answer with each row's ``history``, oldest first."""
        return {**answer, "hosts": [{**row, "history": self.of(row.get("cluster", ""), row["host"])}
                                    for row in answer["hosts"]]}
