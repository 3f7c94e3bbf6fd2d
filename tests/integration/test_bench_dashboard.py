"""What `distrun dashboard` costs training: samples/s with a browser page following the job against
without, in one run (`pytest -m bench`; issue 50 asks for at least 0.98x).

A local mirrored x2 job of a small CPU MLP on the module's local server, trained DISTRUN_BENCH_REPEATS
(2) times each way in the order off, on, on, off (so that a drift of the machine's load falls on
both alike), DISTRUN_BENCH_STEPS (3000) steps a run. "page": the dashboard is running, a headless
chromium has its jobs page open before the job starts (as a lab member's is) and goes to the job's
page once the job is listed, following it to the end over server-sent events (the rank table,
the charts, the logs); "sse": a plain client reads the job page's event stream, no browser;
"off": the dashboard runs but nothing follows the job. The figure
is each run's summary samples/s (the mean after step 1), and the ratio of the means:

    python3 -m pytest -m bench tests/integration/test_bench_dashboard.py -s

The ratio is printed, not asserted (a benchmark, not a timed test: on a shared 2-core machine the
browser competes with the ranks for the cores, which a dashboard on a laptop does not); what is
asserted is that the page really followed each "on" run to its end.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO
from tests.integration.test_dashboard import Served, browser, served  # noqa: F401 - the module's fixtures

pytestmark = [pytest.mark.bench, pytest.mark.integration, pytest.mark.usefixtures("warm_start"),
              pytest.mark.timeout(1800)]

RECIPE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


def model():
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.01)


def loss(outputs, batch):
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    x = torch.randn(8192, 128, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x[:, :1].clone())
"""


def _cpu_s(served: Served) -> dict[str, dict[int, float]]:
    """CPU seconds so far, by pid, of the dashboard's process, the browser's (this test's chromium
    children) and the local server's (which streams the job's events to every follower)."""
    home = os.environ["DISTRUN_HOME"]
    groups: dict[str, list[psutil.Process]] = {
        "dashboard": [psutil.Process(served.proc.pid)],
        "browser": [proc for proc in psutil.Process().children(recursive=True) if "chrom" in proc.name()],
        "server": [proc for proc in psutil.process_iter(["cmdline"]) if "distrun.server" in (proc.info["cmdline"] or [])
                   and any(home in arg for arg in proc.info["cmdline"])],
    }
    found: dict[str, dict[int, float]] = {}
    for name, procs in groups.items():
        found[name] = {}
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            found[name][proc.pid] = times.user + times.system
    return found


def _spent(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, float]:
    return {name: round(sum(value - before[name].get(pid, 0.0) for pid, value in after[name].items()), 2)
            for name in after}


class _Follower(threading.Thread):
    """A plain SSE client of the job's stream (what the page receives, without a browser to draw it):
    the dashboard's own cost, apart from the browser's. Counts the updates until the stream ends."""

    def __init__(self, served: Served, job_id: str) -> None:
        super().__init__(daemon=True)
        self.served, self.job_id, self.updates, self.ended = served, job_id, 0, False

    def run(self) -> None:
        host, port = self.served.netloc.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("GET", f"/api/jobs/{self.job_id}/events",
                     headers={"Host": self.served.netloc, "Authorization": f"Bearer {self.served.token}"})
        answer = conn.getresponse()
        for line in answer:
            if line.startswith(b"data: "):
                self.updates += 1
                self.ended = bool(json.loads(line[len(b"data: "):])["head"]["ended"])
        conn.close()


def _train(recipe: Path, steps: int, served: Served, browser: object | None,  # noqa: F811
           mode: str) -> tuple[float, int, dict[str, float]]:
    """One run (``mode``: off, sse, page): its summary samples/s, the updates the follower got (the loss
    chart's points for a page; 0 when off), and the CPU seconds the dashboard, the browser and the
    local server spent meanwhile."""
    context = page = follower = None
    if mode == "page":  # the dashboard already open, as a lab member's is, when the job starts
        context = browser.new_context()  # type: ignore[attr-defined]
        page = context.new_page()
        page.goto(served.url)
    before = _cpu_s(served)
    proc = subprocess.Popen([sys.executable, "-m", "distrun", "train", str(recipe), "-s", "mirrored", "--replicas", "2",
                             "--global-batch-size", "128", "--steps", str(steps), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ))
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        event = json.loads(line)
        if event["type"] == "job" and page is not None:
            page.goto(f"{served.origin}/jobs/{event['job']}")
        elif event["type"] == "job" and mode == "sse":
            follower = _Follower(served, event["job"])
            follower.start()
    _out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(lines[-1])
    assert summary["type"] == "summary", lines[-1]
    seen = 0
    if page is not None:
        from playwright.sync_api import expect

        expect(page.get_by_role("status")).to_have_text("succeeded", timeout=30_000)  # followed to the end
        seen = int(page.get_by_role("img", name="loss", exact=True).get_attribute("data-points") or 0)
    if follower is not None:
        follower.join(30)
        assert follower.ended, "the event stream did not follow the job to its end"
        seen = follower.updates
    spent = _spent(before, _cpu_s(served))
    if context is not None:
        context.close()
    return float(summary["samples_per_s"]), seen, spent


def test_samples_per_s_with_the_dashboard_following_against_without(browser, served: Served,  # noqa: ANN001, F811
                                                                     tmp_path: Path) -> None:
    steps = int(os.environ.get("DISTRUN_BENCH_STEPS", "3000"))
    repeats = int(os.environ.get("DISTRUN_BENCH_REPEATS", "2"))
    recipe = tmp_path / "dashbench.py"
    recipe.write_text(RECIPE)
    modes = ("off", "sse", "page")
    runs: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu_s: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    warm = browser.new_context()  # the browser as a user's is: started, a page drawn once (its first costs aside)
    warm.new_page().goto(served.url)
    warm.close()
    order = [*modes, *reversed(modes)] * (repeats // 2) + list(modes) * (repeats % 2)
    for mode in order:
        started = time.monotonic()
        rate, seen, spent = _train(recipe, steps, served, browser, mode)
        assert mode == "off" or seen > 0, f"{mode}: the follower saw nothing of the job"
        runs[mode].append(rate)
        cpu_s[mode].append(spent)
        print(f"{mode}: {rate:.1f} samples/s ({time.monotonic() - started:.1f} s; {seen} updates; CPU s {spent}; "
              f"load {os.getloadavg()[0]:.1f})", flush=True)
    mean = {mode: statistics.fmean(rates) for mode, rates in runs.items()}
    report = {"steps": steps, "repeats": repeats, "order": order, "cpus": os.cpu_count(), "machine": platform.node(),
              "samples_per_s": {mode: [round(rate, 1) for rate in rates] for mode, rates in runs.items()},
              "ratio_sse_over_off": round(mean["sse"] / mean["off"], 3),
              "ratio_page_over_off": round(mean["page"] / mean["off"], 3), "cpu_s": cpu_s}
    print(json.dumps(report, indent=1))
    for mode, words in (("sse", "the dashboard following the job (its event stream read, no browser)"),
                        ("page", "a browser page open on the job")):
        print(f"samples/s with {words}: {mean[mode] / mean['off']:.3f}x of without "
              f"({mean[mode]:.1f} against {mean['off']:.1f})")
    assert all(rate > 0 for rate in mean.values())
