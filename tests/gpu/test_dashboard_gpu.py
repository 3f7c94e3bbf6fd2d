"""The dashboard's GPU panels on a real GPU: the Hosts page's NVML readings and a job's per-rank
GPU utilisation, from the same JSON the page draws (tests/integration/test_dashboard.py drives
the page itself in chromium; a GPU machine here has no browser).

A CUDA job holds memory on the device while the dashboard is asked, so "memory used" is not
the idle driver's few MB, and the job's rows carry the utilisation its ranks sampled.

With ``DISTRUN_GPU_RECORD=DIR`` the test also writes the answers it read (``hosts.json``, and
the job page's first event, ``job_event.json``): tests/integration/data/ keeps one such
recording, which tests/integration/test_dashboard.py draws in chromium on a machine with no GPU.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import REPO, local_server
from tests.integration._recipes import SLOW

pytestmark = pytest.mark.gpu


@pytest.fixture
def home(tmp_path: Path) -> Iterator[dict[str, str]]:
    with local_server(tmp_path / "home") as env:
        yield env


def _get(url: str, path: str) -> object:
    parts = urlsplit(url)
    token = parts.query.removeprefix("token=")
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", path, headers={"Host": parts.netloc, "Authorization": f"Bearer {token}"})
        answer = conn.getresponse()
        body = answer.read().decode()
        assert answer.status == 200, (path, answer.status, body[:500])
        return json.loads(body)
    finally:
        conn.close()


def _first_event(url: str, path: str) -> dict:
    """The first server-sent event of ``path``: a job page's whole state (its ``reset`` update)."""
    parts = urlsplit(url)
    token = parts.query.removeprefix("token=")
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", path, headers={"Host": parts.netloc, "Authorization": f"Bearer {token}"})
        answer = conn.getresponse()
        assert answer.status == 200, (path, answer.status)
        while True:
            line = answer.fp.readline().decode()
            assert line, f"{path} ended before its first event"
            if line.startswith("data: "):
                return json.loads(line.removeprefix("data: "))
    finally:
        conn.close()


def test_the_hosts_page_reads_the_gpu_through_nvml_and_a_cuda_jobs_ranks_their_utilisation(home, tmp_path):
    recipe = tmp_path / "slow.py"
    recipe.write_text(SLOW)
    env = {**os.environ, **home}
    out, err = tmp_path / "job.jsonl", tmp_path / "job.err"  # files: a pipe nobody reads would stall the job
    with out.open("w") as out_file, err.open("w") as err_file:
        job = subprocess.Popen([sys.executable, "-m", "distrun", "train", str(recipe), "--device", "cuda", "--steps",
                                "100000", "--json", "--log-interval-s", "0.2"],
                               stdout=out_file, stderr=err_file, text=True, cwd=REPO, env=env)
    dashboard = subprocess.Popen([sys.executable, "-m", "distrun", "dashboard", "--port", "0", "--no-browser"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=env)
    try:
        assert dashboard.stdout is not None
        deadline = time.monotonic() + 120
        while True:  # a few steps in: the ranks have sampled the GPU
            events = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
            if sum(event["type"] == "step" for event in events) >= 5:
                break
            assert job.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
            time.sleep(0.2)
        job_id = next(event["job"] for event in events if event["type"] == "job")
        found = re.fullmatch(r"distrun dashboard: (http://\S+)\n", dashboard.stdout.readline())
        assert found, "no URL from the dashboard"
        url = found.group(1)

        _get(url, "/api/hosts")
        time.sleep(1.2)  # a second sample, apart by more than the history's MIN_GAP_S: the charts draw lines
        report = _get(url, "/api/hosts")
        hosts = report["hosts"]
        print("hosts:", json.dumps(hosts)[:2000])
        server = hosts[0]["server"]
        assert server["gpu_note"] is None and server["gpus"], server
        for gpu in server["gpus"]:
            assert "NVIDIA" in gpu["name"] and 0 <= gpu["util_pct"] <= 100, gpu
            assert 0 < gpu["memory_used_bytes"] < gpu["memory_total_bytes"], gpu
        assert server["gpus"][0]["memory_used_bytes"] > 100 * 2**20, "the CUDA job's memory is not in NVML's reading"
        latest = hosts[0]["history"][-1]  # the use-over-time charts' newest sample, GPUs averaged
        assert latest["gpu_util_pct"] is not None and latest["gpu_memory_pct"] > 0, hosts[0]["history"]

        deadline = time.monotonic() + 30
        while True:  # the job's page: its rank rows, as the live table has them
            rows = _get(url, f"/api/jobs/{job_id}")["rows"]
            if rows and rows[0]["gpu_util"] is not None:
                break
            assert time.monotonic() < deadline, f"no GPU utilisation in the job's rows after 30 s: {rows}"
            time.sleep(0.5)
        print("rows:", json.dumps(rows))
        assert rows[0]["device"].startswith("cuda") and 0 <= rows[0]["gpu_util"] <= 100 and rows[0]["mem_mb"] > 0, rows
        event = _first_event(url, f"/api/jobs/{job_id}/events")
        assert event["reset"] and event["rows"][0]["device"].startswith("cuda"), event["rows"]
        if os.environ.get("DISTRUN_GPU_RECORD"):
            folder = Path(os.environ["DISTRUN_GPU_RECORD"])
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts.json").write_text(json.dumps(report, indent=1))
            (folder / "job_event.json").write_text(json.dumps(event, indent=1))
    finally:
        for proc in (dashboard, job):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in (dashboard, job):
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
