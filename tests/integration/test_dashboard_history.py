"""The dashboard's history and its end (issue 50): a finished job is still listed, with its page,
after its server is restarted (`distrun down`, `distrun up`), from the job's records on disk; a
failed job's root cause (rank, error, the recipe's line) in its row, its state and its events; and
stopping the dashboard with Ctrl-C while it follows a running job leaves the job running.

Plain HTTP against a real `distrun dashboard` on a real local server of its own (the browser is
tests/integration/test_dashboard.py's)."""

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
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import REPO, interrupt, local_server, run_cli
from tests.integration._recipes import EQUIV, SLOW

pytestmark = pytest.mark.integration


@contextmanager
def _dashboard(env: dict[str, str]) -> Iterator[str]:
    """`distrun dashboard --port 0 --no-browser` on ``env``'s server; its URL. Ctrl-C at the end, which
    must end it cleanly."""
    proc = subprocess.Popen([sys.executable, "-m", "distrun", "dashboard", "--port", "0", "--no-browser"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, **env})
    assert proc.stdout is not None
    found = re.fullmatch(r"distrun dashboard: (http://\S+)\n", proc.stdout.readline())
    try:
        assert found, f"no URL from `distrun dashboard`: {proc.stderr.read()[-2000:] if proc.stderr else ''}"
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("the dashboard did not end within 15 s of Ctrl-C") from None
        assert proc.returncode == 0 and "dashboard stopped" in err, (proc.returncode, err[-2000:])


def _get(url: str, path: str) -> dict:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("GET", path, headers={"Host": parts.netloc,
                                           "Authorization": f"Bearer {parts.query.removeprefix('token=')}"})
        answer = conn.getresponse()
        body = answer.read().decode()
        assert answer.status == 200, (path, answer.status, body[:500])
        return json.loads(body)
    finally:
        conn.close()


def _listed(env: dict[str, str]) -> dict[str, dict]:
    listed = run_cli("jobs", "--json", env=env)
    assert listed.returncode == 0, listed.stderr[-2000:]
    return {row["job"]: row for row in map(json.loads, listed.stdout.splitlines())}


def test_a_finished_job_is_listed_with_its_page_after_its_server_restarts(tmp_path: Path) -> None:
    recipe = tmp_path / "past.py"
    recipe.write_text(EQUIV)
    home = tmp_path / "home"
    with local_server(home) as env:
        trained = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "4", "--json", env=env)
        assert trained.returncode == 0, trained.stderr[-2000:]
        job = next(line["job"] for line in trained.json_lines() if line["type"] == "job")
        before = _listed(env)[job]
    # `down` stopped that server; a new one has nothing of the job in memory, only its folder.
    with local_server(home) as env:
        row = _listed(env)[job]
        assert (row["state"], row["recipe"], row["strategy"], row["world_size"]) == \
            ("succeeded", "past.py", "mirrored", 2), row
        assert row["started_at"] == before["started_at"], (row, before)
        with _dashboard(env) as url:
            jobs = {entry["job"]: entry for entry in _get(url, "/api/jobs")["jobs"]}
            assert job in jobs, sorted(jobs)
            assert (jobs[job]["state"], jobs[job]["recipe"]) == ("succeeded", "past.py"), jobs[job]
            # The job's page: rebuilt from its log on disk (the first answer may still be connecting).
            page = _wait_for(lambda: (answer := _get(url, f"/api/jobs/{job}"))["head"]["ended"] and answer, "its end")
            assert page["head"]["state"] == "succeeded" and page["head"]["step"] == 4, page["head"]
            assert sorted(row["rank"] for row in page["rows"]) == [0, 1], page["rows"]
            assert len(page["points"]) >= 1, page
            # A failed job: its root cause (the recipe's line, the rank) in its row and on its page.
            failing = tmp_path / "failing.py"
            failing.write_text(FAILING)
            failed = run_cli("train", str(failing), "-s", "mirrored", "--replicas", "2", "--steps", "20", "--json",
                             env=env)
            assert failed.returncode == 4, failed.stderr[-2000:]
            broken = next(line["job"] for line in failed.json_lines() if line["type"] == "job")
            line = next(number for number, text in enumerate(FAILING.splitlines(), 1) if "1 / 0" in text)
            cause = re.compile(rf"failing\.py:{line}: rank 1 failed at step 3: ZeroDivisionError: division by zero")
            row = _wait_for(lambda: next((entry for entry in _get(url, "/api/jobs")["jobs"] if entry["job"] == broken),
                                         None), "the failed job's row")
            assert row["state"] == "failed" and cause.search(row["why"] or ""), row
            page = _wait_for(lambda: (answer := _get(url, f"/api/jobs/{broken}"))["head"]["ended"] and answer, "its end")
            assert page["head"]["state"] == "failed" and cause.search(page["head"]["reason"] or ""), page["head"]
            assert any(cause.search(event["text"]) for event in page["events"]), page["events"]


#: Rank 1 divides by zero at its third step.
FAILING = """
import os
import torch
from torch import nn
from torch.utils.data import TensorDataset

RANK = int(os.environ["RANK"])
calls = [0]


def model():
    return nn.Linear(2, 1)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05)


def loss(outputs, batch):
    calls[0] += 1
    if RANK == 1 and calls[0] == 3:
        return 1 / 0
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    x = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))
"""


def test_ctrl_c_of_the_dashboard_leaves_the_job_it_follows_running(tmp_path: Path) -> None:
    """The dashboard follows a job as `attach` does; its end detaches, never cancels."""
    recipe = tmp_path / "slow.py"
    recipe.write_text(SLOW)
    out = tmp_path / "job.jsonl"  # a file: a pipe nobody reads would stall the job
    with local_server(tmp_path / "home") as env, out.open("w") as out_file:
        train = subprocess.Popen([sys.executable, "-m", "distrun", "train", str(recipe), "--steps", "100000", "--json",
                                  "--log-interval-s", "0.2"], stdout=out_file, stderr=subprocess.DEVNULL,
                                 text=True, cwd=REPO, env={**os.environ, **env})
        try:
            job = _wait_for(lambda: next((e["job"] for e in _events(out) if e["type"] == "job"), None), "job line")
            with _dashboard(env) as url:
                page = _wait_for(lambda: (answer := _get(url, f"/api/jobs/{job}")).get("rows") and answer, "rows")
                first = page["head"]["step"]
            # The dashboard is gone: the job is still running, and goes on stepping.
            assert train.poll() is None, "the job ended with the dashboard"
            assert _listed(env)[job]["state"] == "running"
            _wait_for(lambda: max((e["step"] for e in _events(out) if e["type"] == "step"), default=0) > first + 5,
                      f"steps past {first} + 5")
            assert train.poll() is None and _listed(env)[job]["state"] == "running"
        finally:
            interrupt(train)


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{") and line.endswith("}")]


def _wait_for(probe, what: str, timeout_s: float = 60.0):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout_s
    while not (value := probe()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.3)
    return value


def test_without_no_browser_it_opens_the_url_in_the_users_browser(tmp_path: Path) -> None:
    """`webbrowser` runs $BROWSER with the URL: here a program that writes down what it was given."""
    opened = tmp_path / "opened.txt"
    browser = tmp_path / "browser.sh"
    browser.write_text(f'#!/bin/sh\nprintf "%s" "$1" > {opened}\n')
    browser.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "distrun", "dashboard", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "BROWSER": str(browser), "DISTRUN_HOME": str(tmp_path / "home")})
    try:
        assert proc.stdout is not None
        found = re.fullmatch(r"distrun dashboard: (http://127\.0\.0\.1:\d+/\?token=[\w-]{40,})\n", proc.stdout.readline())
        assert found, proc.stderr.read()[-2000:] if proc.stderr else "no URL"
        assert _wait_for(lambda: opened.is_file() and opened.read_text(), "the browser's start", 20) == found.group(1)
    finally:
        interrupt(proc, 15)
