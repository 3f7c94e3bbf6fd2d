"""The hosts page's use over time: what the dashboard keeps of each host's `status` answers."""

from __future__ import annotations

import time

import pytest

from distrun.dashboard._host_history import HostHistory, sample_of
from distrun.server._hostinfo import _CpuUse

GIB = 2**30


def _server(cpu: float | None = 25.0, available_gib: float = 6.0, gpus: list[dict] | None = None) -> dict:
    return {"memory_total_bytes": 8 * GIB, "memory_available_bytes": int(available_gib * GIB), "cpu_pct": cpu,
            "gpus": gpus or [], "gpu_note": None if gpus else "NVML not found: no pynvml"}


def _row(host: str, server: dict | None, cluster: str = "lab") -> dict:
    return {"cluster": cluster, "host": host, "server": server}


def test_a_sample_is_percentages_with_the_gpus_averaged_and_none_where_nothing_was_said():
    gpus = [{"index": 0, "util_pct": 90.0, "memory_used_bytes": 30 * GIB, "memory_total_bytes": 80 * GIB},
            {"index": 1, "util_pct": 10.0, "memory_used_bytes": 10 * GIB, "memory_total_bytes": 80 * GIB}]
    sample = sample_of(_server(gpus=gpus), 100.0)
    assert sample is not None
    assert (sample.cpu_pct, sample.memory_pct, sample.gpu_util_pct, sample.gpu_memory_pct) == (25.0, 25.0, 50.0, 25.0)
    plain = sample_of(_server(cpu=None), 100.0)  # an older server, or its first answer; no GPU
    assert plain is not None and (plain.cpu_pct, plain.gpu_util_pct, plain.gpu_memory_pct) == (None, None, None)
    assert sample_of(None, 100.0) is None  # a host whose server did not answer: a gap, never a zero


def test_each_host_keeps_its_newest_samples_and_answers_close_together_count_once(monkeypatch: pytest.MonkeyPatch):
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    history = HostHistory(keep=3)
    for step in range(5):
        history.record([_row("a", _server(cpu=float(step))), _row("b", None)])
        clock[0] += 0.4  # a second page's answer 0.4 s later is not a new sample
        history.record([_row("a", _server(cpu=99.0))])
        clock[0] += 1.6
    kept = history.of("lab", "a")
    assert [sample["cpu_pct"] for sample in kept] == [2.0, 3.0, 4.0]  # the newest three, oldest first
    assert [sample["time"] for sample in kept] == [1004.0, 1006.0, 1008.0]
    assert history.of("lab", "b") == [] and history.of("other", "a") == []  # per cluster and host
    answer = history.with_history({"cluster": "lab", "hosts": [_row("a", _server()), _row("b", None)]})
    assert len(answer["hosts"][0]["history"]) == 3 and answer["hosts"][1]["history"] == []


def test_the_servers_cpu_use_is_none_first_then_a_share_of_the_interval():
    use = _CpuUse()
    assert use.percent() is None  # no interval yet: psutil's first reading means nothing
    sum(i * i for i in range(200_000))
    second = use.percent()
    assert second is not None and 0.0 <= second <= 100.0
