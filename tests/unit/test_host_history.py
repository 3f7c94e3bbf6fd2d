"""The hosts page's use over time: what the dashboard keeps of each host's `status` answers."""

from __future__ import annotations

import threading
import time

import pytest

from distrun.dashboard import _server
from distrun.dashboard._host_history import HostHistory, sample_of
from distrun.protocol.cluster import ServerInfo
from distrun.server._hostinfo import _CpuUse

GIB = 2**30


def _server_said(cpu: float | None = 25.0, available_gib: float = 6.0, gpus: list[dict] | None = None) -> dict:
    return {"memory_total_bytes": 8 * GIB, "memory_available_bytes": int(available_gib * GIB), "cpu_pct": cpu,
            "gpus": gpus or [], "gpu_note": None if gpus else "NVML not found: no pynvml"}


def _row(host: str, server: dict | None, cluster: str = "lab") -> dict:
    return {"cluster": cluster, "host": host, "server": server}


def test_a_sample_is_percentages_with_the_gpus_averaged_and_none_where_nothing_was_said():
    gpus = [{"index": 0, "util_pct": 90.0, "memory_used_bytes": 30 * GIB, "memory_total_bytes": 80 * GIB},
            {"index": 1, "util_pct": 10.0, "memory_used_bytes": 10 * GIB, "memory_total_bytes": 80 * GIB}]
    sample = sample_of(_server_said(gpus=gpus, available_gib=5.5), 100.0)
    assert (sample.cpu_pct, sample.memory_pct, sample.gpu_util_pct, sample.gpu_memory_pct) == (25.0, 31.2, 50.0, 25.0)
    plain = sample_of(_server_said(cpu=None), 100.0)  # an older server, or its first answer; no GPU
    assert (plain.cpu_pct, plain.memory_pct, plain.gpu_util_pct, plain.gpu_memory_pct) == (None, 25.0, None, None)
    gone = sample_of(None, 100.0)  # a host whose server did not answer: a gap in every chart, never a zero
    assert (gone.time, gone.cpu_pct, gone.memory_pct, gone.gpu_util_pct, gone.gpu_memory_pct) == (100.0,) + (None,) * 4


def test_each_host_keeps_the_last_hour_and_answers_close_together_count_once(monkeypatch: pytest.MonkeyPatch):
    wall, mono = [1000.0], [50.0]
    monkeypatch.setattr(time, "time", lambda: wall[0])
    monkeypatch.setattr(time, "monotonic", lambda: mono[0])

    def tick(seconds: float) -> None:
        wall[0] += seconds
        mono[0] += seconds

    history = HostHistory(keep=3, history_s=100.0)
    for step in range(5):
        history.record([_row("a", _server_said(cpu=float(step))), _row("b", None)])
        tick(0.4)  # a second page's answer 0.4 s later is not a new sample
        history.record([_row("a", _server_said(cpu=99.0))])
        tick(1.6)
    kept = history.of("lab", "a")
    assert [sample["cpu_pct"] for sample in kept] == [2.0, 3.0, 4.0]  # the newest three, oldest first
    assert [sample["time"] for sample in kept] == [1004.0, 1006.0, 1008.0]
    assert [sample["memory_pct"] for sample in history.of("lab", "b")] == [None, None, None]  # its gaps
    assert history.of("other", "a") == []  # per cluster and host
    answer = history.with_history({"cluster": "lab", "hosts": [_row("a", _server_said())]})
    assert len(answer["hosts"][0]["history"]) == 3
    wall[0] -= 500  # the wall clock stepped back: the gap is on the monotonic clock, nothing is lost
    tick(2.0)
    history.record([_row("a", _server_said(cpu=7.0))])
    assert history.of("lab", "a")[-1]["cpu_pct"] == 7.0
    wall[0] += 1000  # an hour's silence (here, history_s): b is forgotten, a keeps its new sample only
    tick(1000)
    history.record([_row("a", _server_said(cpu=8.0))])
    assert [sample["cpu_pct"] for sample in history.of("lab", "a")] == [8.0] and history.of("lab", "b") == []


def test_the_servers_cpu_use_is_none_first_then_a_share_of_the_interval_shared_by_close_callers():
    use = _CpuUse()
    assert use.percent() is None  # no interval yet: psutil's first reading means nothing
    time.sleep(0.6)
    second = use.percent()
    assert second is not None and 0.0 <= second <= 100.0
    assert use.percent() == second  # a caller 0.5 s after another gets its reading, not psutil's noise


def test_an_older_servers_status_without_cpu_pct_reads_and_a_newer_ones_extra_key_is_ignored():
    info = {"version": "0.1.0", "protocol": 1, "pid": 1, "state_dir": "/s", "hostname": "h", "python": "3.11",
            "started_at": 0.0, "uptime_s": 1.0, "cpu_count": 2, "memory_total_bytes": 1, "memory_available_bytes": 1,
            "load_1m": 0.0, "gpu_count": 0, "gpu_names": [], "jobs_running": 0, "config_sha256": "x", "warm": True}
    assert ServerInfo.from_dict(info).cpu_pct is None
    assert ServerInfo.from_dict({**info, "cpu_pct": 12.5, "from_the_future": 1}).cpu_pct == 12.5


class _Hosts:
    """A Sources stand-in for the sampler: it fails once, then answers one host."""

    name = "lab"

    def __init__(self) -> None:
        self.asked = 0

    def hosts(self) -> dict:
        self.asked += 1
        if self.asked == 1:
            raise RuntimeError("the first ask fails")
        return {"cluster": "lab", "hosts": [_row("h1", _server_said(cpu=float(self.asked)))]}

    def close(self) -> None:
        pass


def test_the_sampler_asks_when_no_page_did_outlives_a_failure_and_ends_with_the_dashboard(monkeypatch):
    monkeypatch.setattr(_server, "SAMPLE_EVERY_S", 1.05)  # above MIN_GAP_S: each ask is a sample
    source = _Hosts()
    dashboard = _server.Dashboard.bind(source, "127.0.0.1", 0)  # type: ignore[arg-type]
    serving = threading.Thread(target=dashboard.serve)
    serving.start()
    try:
        deadline = time.monotonic() + 15
        while len(dashboard.history.of("lab", "h1")) < 2:
            assert time.monotonic() < deadline, f"the sampler asked {source.asked} time(s) in 15 s"
            time.sleep(0.05)
    finally:
        dashboard.stop()
        serving.join(10)
    assert not serving.is_alive()
    assert [s["cpu_pct"] for s in dashboard.history.of("lab", "h1")][:2] == [2.0, 3.0]  # the failure first, survived
    assert not [t for t in threading.enumerate() if t.name == "dashboard-hosts"], "the sampler outlived the dashboard"
