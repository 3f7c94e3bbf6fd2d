"""`distrun dashboard` (issue 50): a real local mirrored x2 job on a real local server, its page in
a real headless browser (Playwright driving Debian's chromium), and the guard held by plain HTTP.

One dashboard, one job and one browser serve the whole module; the browser test runs the job's
life in order (listed, live page, logs, stacks, cancel, the page after the end), the security
test runs while the job is still running so that its data is there to leak.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from distrun import __version__
from tests.conftest import REPO, interrupt
from tests.integration._recipes import SLOW_RANK_RECIPE

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]

CHROMIUM = "/usr/bin/chromium"
#: A recipe that runs until it is cancelled: a print per rank, and a function of its own in every step.
RECIPE = """
import os
import time
import torch
from torch import nn
from torch.utils.data import TensorDataset

RANK = int(os.environ["RANK"])
print(f"hello from rank {RANK}", flush=True)


def model():
    return nn.Linear(2, 1)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05)


def dashboard_marker_pause():
    time.sleep(0.04)


_calls = [0]


def loss(outputs, batch):
    dashboard_marker_pause()
    _calls[0] += 1
    if RANK == 0 and _calls[0] % 5 == 0:
        print(f"tick {_calls[0]}", flush=True)
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 2, generator=gen)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))
"""


@dataclass(frozen=True)
class Served:
    proc: subprocess.Popen[str]
    url: str  # the printed one, with the token

    @property
    def origin(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def netloc(self) -> str:
        return urlsplit(self.url).netloc

    @property
    def token(self) -> str:
        return urlsplit(self.url).query.removeprefix("token=")


@dataclass(frozen=True)
class Job:
    proc: subprocess.Popen[str]
    id: str
    recipe: str


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One headless chromium for the module; a missing prerequisite fails with its reason."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.fail(f"playwright is not installed ({exc}): pip install -e '.[test]'")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no {CHROMIUM}: apt-get install -y chromium (Playwright's own download needs the internet)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def served(warm_start: None) -> Iterator[Served]:
    """`distrun dashboard --port 0 --no-browser` on this module's local server; Ctrl-C ends it, cleanly."""
    proc = subprocess.Popen([sys.executable, "-m", "distrun", "dashboard", "--port", "0", "--no-browser"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ))
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    found = re.fullmatch(r"distrun dashboard: (http://127\.0\.0\.1:\d+/\?token=[\w-]{40,})\n", line)
    if found is None:
        proc.kill()
        pytest.fail(f"no URL from `distrun dashboard`: {line!r} {proc.stderr.read()[-2000:]}")
    try:
        yield Served(proc, found.group(1))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            _out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("the dashboard did not end within 15 s of Ctrl-C") from None
        assert proc.returncode == 0 and "dashboard stopped" in err, (proc.returncode, err[-2000:])


@pytest.fixture(scope="module")
def job(warm_start: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """A local mirrored x2 job that trains until it is cancelled, listed on the local server."""
    recipe = tmp_path_factory.mktemp("dashboard") / "dashjob.py"
    recipe.write_text(RECIPE)
    proc = subprocess.Popen([sys.executable, "-m", "distrun", "train", str(recipe), "-s", "mirrored", "--replicas", "2",
                             "--global-batch-size", "8", "--steps", "100000", "--json", "--log-interval-s", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ))
    assert proc.stdout is not None
    job_id = ""
    deadline = time.monotonic() + 90
    while True:
        assert time.monotonic() < deadline, "the job reached no step in 90 s"
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-2000:] if proc.stderr else "no output"
        event = json.loads(line)
        if event["type"] == "job":
            job_id = event["job"]
        elif event["type"] == "step":
            break
    assert job_id.startswith("local-"), "the job is listed on the local server"
    try:
        yield Job(proc, job_id, recipe.name)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _ask(served: Served, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """One plain HTTP request (no cookie jar, no redirects): status, headers, the first 64 KiB of the body."""
    host, port = served.netloc.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, headers={"Host": served.netloc, **(headers or {})})
        answer = conn.getresponse()
        body = answer.read(65536).decode(errors="replace") if method != "HEAD" else ""
        return answer.status, {name.lower(): value for name, value in answer.getheaders()}, body
    finally:
        conn.close()


def test_every_route_is_refused_without_the_token_and_to_foreign_hosts_and_origins(served: Served, job: Job) -> None:
    routes = ["/", "/hosts", f"/jobs/{job.id}", "/static/app.js", "/static/style.css", "/api/jobs",
              "/api/jobs/events", "/api/hosts", f"/api/jobs/{job.id}", f"/api/jobs/{job.id}/events", "/nowhere"]
    bearer = {"Authorization": f"Bearer {served.token}"}
    for path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Cookie": "distrun_dashboard=wrong"}):
            status, got, body = _ask(served, "GET", path, headers)
            assert status in (401, 403), (path, headers, status)
            assert job.id not in body and job.recipe not in body and "<html" not in body, (path, body)
            assert "access-control-allow-origin" not in got
    for action in ("cancel", "stacks"):  # an action without the token, even from the page's own origin
        status, _, body = _ask(served, "POST", f"/api/jobs/{job.id}/{action}", {"Origin": served.origin})
        assert status in (401, 403) and job.id not in body, (action, status, body)
    status, _, body = _ask(served, "GET", "/?token=" + "x" * len(served.token))  # a wrong token, as long as the right one
    assert status == 403 and "wrong token" in body, (status, body)
    # The right token, from a foreign Host (DNS rebinding) or Origin (another site), is refused too.
    assert _ask(served, "GET", "/api/jobs", {**bearer, "Host": f"attacker.example:{served.netloc.split(':')[1]}"})[0] == 403
    assert _ask(served, "GET", "/api/jobs", {**bearer, "Origin": "http://attacker.example"})[0] == 403
    status, _, body = _ask(served, "POST", f"/api/jobs/{job.id}/stacks", {**bearer, "Origin": "http://attacker.example"})
    assert status == 403 and job.id not in body, (status, body)
    assert _ask(served, "POST", f"/api/jobs/{job.id}/stacks", bearer)[0] == 403  # an action must name its Origin
    assert _ask(served, "GET", f"/api/jobs/{job.id}/cancel", bearer)[0] == 404  # actions are POST only
    assert _ask(served, "OPTIONS", "/api/jobs", {**bearer, "Origin": "http://attacker.example"})[0] in (403, 405)
    # The token itself: traded for an HttpOnly, SameSite=Strict cookie; with it the data is there.
    status, got, _ = _ask(served, "GET", f"/?token={served.token}")
    assert status == 303 and got["location"] == "/", (status, got)
    cookie = got["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
    status, got, body = _ask(served, "GET", "/api/jobs", {"Cookie": cookie.split(";")[0]})
    assert status == 200 and job.id in body, (status, body[:500])
    assert got["content-security-policy"] == "default-src 'self'" and "access-control-allow-origin" not in got


def test_a_local_job_live_in_the_browser_then_stacked_and_cancelled(browser, served: Served, job: Job) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    context = browser.new_context()
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.goto(served.url)
    assert page.url == served.origin + "/", "the token leaves the address bar for a cookie"

    # The jobs page lists the job, newest first, as a link named by its recipe file.
    row = page.locator(f"tr[data-job='{job.id}']")
    expect(row).to_be_visible(timeout=15_000)
    cells = row.get_by_role("cell")
    expect(cells.nth(2)).to_have_text("running")
    expect(cells.nth(13)).to_have_text("local")  # no CLUSTER: this machine's server, labelled
    # Its figures, from its event log: step/total, loss, samples/s; its layout, ranks, hosts and times.
    expect(cells.nth(3)).to_have_text(re.compile(r"^[1-9]\d*/100000$"), timeout=15_000)
    for i in (4, 5):  # loss and samples/s: numbers
        expect(cells.nth(i)).to_have_text(re.compile(r"^\d[\d.,e+-]*$"))
    assert [cells.nth(i).inner_text() for i in (6, 7, 8, 9)] == ["mirrored", "dp 2", "2", "1: localhost"]
    expect(cells.nth(10)).to_have_text(re.compile(r"\d\d:\d\d"))  # started, as a time of day
    expect(cells.nth(11)).to_have_text(re.compile(r"^(\d+m )?\d+s$"))  # wall time
    row.get_by_role("link", name=job.recipe).click()
    page.wait_for_url(f"**/jobs/{job.id}")

    # Its page: two rank rows whose steps advance, a loss chart that gains points.
    ranks = page.get_by_role("table", name="ranks")
    expect(ranks.get_by_role("columnheader", name="rank", exact=True)).to_be_visible()
    body_rows = ranks.locator("tbody tr")
    expect(body_rows).to_have_count(2, timeout=15_000)
    loss_chart = page.get_by_role("img", name="loss", exact=True)
    expect(page.get_by_role("img", name="samples/s", exact=True)).to_be_visible()
    for figure in ("samples/s", "lr"):  # every chart draws the steps, not only the loss
        expect(page.get_by_role("img", name=figure, exact=True)).to_have_attribute(
            "data-points", re.compile(r"^[1-9]\d*$"), timeout=15_000)
    first_steps = [int(body_rows.nth(i).get_by_role("cell").nth(3).inner_text()) for i in range(2)]
    first_points = int(loss_chart.get_attribute("data-points") or 0)
    deadline = time.monotonic() + 20
    while True:
        steps = [int(body_rows.nth(i).get_by_role("cell").nth(3).inner_text()) for i in range(2)]
        points = int(loss_chart.get_attribute("data-points") or 0)
        if all(now > before for now, before in zip(steps, first_steps)) and points > first_points:
            break
        assert time.monotonic() < deadline, f"no progress on the page: steps {first_steps} -> {steps}, points {first_points} -> {points}"
        time.sleep(0.3)
    assert [body_rows.nth(i).get_by_role("cell").nth(0).inner_text() for i in range(2)] == ["0", "1"]
    # The wait share per rank (the step's wait for its peer over its wall time), as a percentage.
    expect(ranks.get_by_role("columnheader", name="wait", exact=True)).to_be_visible()
    for i in range(2):
        expect(body_rows.nth(i).get_by_role("cell").nth(9)).to_have_text(re.compile(r"^\d{1,3}%$"), timeout=10_000)
    expect(page.locator("dl.summary dt:text-is('cluster') + dd")).to_have_text("local")  # the job's cluster
    events = page.get_by_role("list", name="events")
    expect(events).to_contain_text("rank 0 started on cpu")
    expect(events).to_contain_text("rank 1 started on cpu")

    # The logs, under the rank filter and the text filter.
    logs = page.get_by_role("log", name="logs")
    expect(logs).to_contain_text("hello from rank 1")
    # Live: lines printed while the page is open arrive, and the follow switch keeps the newest in view.
    seen = max(int(n) for n in re.findall(r"tick (\d+)", logs.inner_text()) or ["0"])
    expect(logs).to_contain_text(f"tick {seen + 10}", timeout=15_000)
    expect(page.locator("#follow")).to_be_checked()
    at_end = "(e) => e.scrollHeight > e.clientHeight && e.scrollTop + e.clientHeight >= e.scrollHeight - 2"
    page.wait_for_function(f"() => ({at_end})(document.querySelector('pre.logs'))", timeout=15_000)
    page.locator("#follow").uncheck()
    logs.evaluate("(e) => { e.scrollTop = 0; }")
    seen = max(int(n) for n in re.findall(r"tick (\d+)", logs.inner_text()))
    expect(logs).to_contain_text(f"tick {seen + 10}", timeout=15_000)  # lines still come, the view stays put
    assert logs.evaluate("(e) => e.scrollTop") == 0
    page.locator("#follow").check()
    page.get_by_label("rank filter").select_option("0")
    expect(logs).to_contain_text("hello from rank 0")
    expect(logs).not_to_contain_text("hello from rank 1")
    page.get_by_label("rank filter").select_option("")
    page.get_by_label("text filter").fill("rank 1")
    expect(logs).to_contain_text("hello from rank 1")
    expect(logs).not_to_contain_text("hello from rank 0")

    # Stacks: every rank's, with the recipe's own function in them.
    page.get_by_role("button", name="Stacks").click()
    stacks = page.get_by_role("region", name="stacks")
    expect(stacks).to_contain_text("dashboard_marker_pause", timeout=40_000)
    expect(stacks.locator("article")).to_have_count(2)

    # Cancel: the job ends, `distrun train` exits with the cancelled code (130), the page says so.
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel").click()
    _out, err = job.proc.communicate(timeout=30)
    assert job.proc.returncode == 130, err[-2000:]
    assert "cancelled by " in err.strip().splitlines()[-1], err[-2000:]
    state = page.get_by_role("status")
    expect(state).to_contain_text("stopped", timeout=15_000)
    expect(state).to_contain_text("cancelled by ")
    expect(page.get_by_role("button", name="Cancel")).to_be_disabled()

    # A finished job keeps its page: after a reload, the ranks, the chart and the logs are back.
    page.reload()
    expect(page.get_by_role("status")).to_contain_text("cancelled by ", timeout=15_000)
    expect(page.get_by_role("table", name="ranks").locator("tbody tr")).to_have_count(2)
    assert int(page.get_by_role("img", name="loss", exact=True).get_attribute("data-points") or 0) >= points
    expect(page.get_by_role("log", name="logs")).to_contain_text("hello from rank 0")
    page.goto(served.origin + "/")
    expect(page.locator(f"tr[data-job='{job.id}']").get_by_role("cell").nth(2)).to_have_text("stopped", timeout=15_000)

    # Hosts: this machine's server, and its GPU panel saying why there is none (the probe ran on the server).
    # One answer recorded before the page's own: its use charts have at least two samples.
    status, _, body = _ask(served, "GET", "/api/hosts", {"Authorization": f"Bearer {served.token}"})
    assert status == 200 and json.loads(body)["hosts"][0]["history"], body[:500]
    time.sleep(1.1)  # apart by more than the history's MIN_GAP_S
    page.goto(served.origin + "/hosts")
    hosts = page.get_by_role("table", name="hosts").locator("tbody tr")
    expect(hosts).to_have_count(1, timeout=15_000)
    expect(hosts.get_by_role("cell").nth(2)).to_have_text("up")
    expect(hosts.get_by_role("cell").nth(3)).to_have_text(__version__)  # the server's distrun
    # This machine's server runs in the host's python as it is (no `up` built it an environment).
    expect(hosts.get_by_role("cell").nth(4)).to_have_text(re.compile(r"^host python · Python 3\.\d+\.\d+$"))
    expect(hosts.get_by_role("cell").nth(13)).to_have_text("local")
    expect(hosts.get_by_role("cell").nth(14)).to_have_text(re.compile(r"^no GPU \(NVML not found: .+\)$"))
    for figure in ("cpu %", "memory %"):  # over time, 0-100, from the dashboard's samples of the host
        chart = hosts.get_by_role("img", name=re.compile(f"^{figure} of "))
        expect(chart).to_have_attribute("data-points", re.compile(r"^([2-9]|\d\d+)$"), timeout=15_000)
        expect(chart.locator("title")).to_have_text(re.compile(rf"^{figure} of \S+: [\d.]+ at "))
    expect(hosts.get_by_role("img", name=re.compile("^GPU"))).to_have_count(0)  # no GPU, no GPU chart
    context.close()
    assert not problems, problems


def test_a_slow_rank_is_flagged_in_its_row_the_header_and_the_events(browser, served: Served,  # noqa: ANN001
                                                                     tmp_path: Path) -> None:
    """Rank 1 of 3 sleeps 120 ms a step against the others' 30 ms: the page flags it as the live view
    does (the same judgement: docs/debugging.md#slow-ranks)."""
    from playwright.sync_api import expect

    recipe = tmp_path / "slowone.py"
    recipe.write_text(SLOW_RANK_RECIPE)
    out = tmp_path / "job.jsonl"
    with out.open("w") as out_file:
        proc = subprocess.Popen([sys.executable, "-m", "distrun", "train", str(recipe), "-s", "mirrored", "--replicas",
                                 "3", "--steps", "100000", "--json", "--log-interval-s", "0.1", "--", "--slow-rank",
                                 "1"], stdout=out_file, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                                env=dict(os.environ))
    context = browser.new_context()
    try:
        deadline = time.monotonic() + 60
        while not (job_id := next((json.loads(line)["job"] for line in out.read_text().splitlines()
                                   if line.startswith('{"type":"job"')), None)):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-2000:]
            time.sleep(0.2)
        page = context.new_page()
        page.goto(served.url)
        page.goto(served.origin + f"/jobs/{job_id}")
        rows = page.get_by_role("table", name="ranks").locator("tbody tr")
        expect(rows).to_have_count(3, timeout=30_000)
        expect(rows.nth(1).get_by_role("cell").nth(11)).to_have_text(re.compile(r"^running, slow \d+\.\d\dx$"),
                                                                     timeout=60_000)
        for i in (0, 2):
            expect(rows.nth(i).get_by_role("cell").nth(11)).to_have_text("running")
        expect(page.locator("dl.summary dt:text-is('straggler') + dd")).to_have_text(
            re.compile(r"^rank 1 \(localhost\) \d+\.\d\dx the other ranks' median compute time"))
        expect(page.get_by_role("list", name="events")).to_contain_text("rank 1 on localhost is slow: ")
        # The hosts page names the job running on this host, a link to its page.
        page.goto(served.origin + "/hosts")
        here = page.get_by_role("table", name="hosts").locator("tbody tr").get_by_role("cell").nth(9)
        expect(here.get_by_role("link", name="slowone.py")).to_have_attribute("href", f"/jobs/{job_id}", timeout=15_000)
        expect(here).to_have_text(re.compile(r"^\d+: .*slowone\.py"))
    finally:
        context.close()
        interrupt(proc)


#: What a dashboard answered on an NVIDIA H200 host while a CUDA job ran (tests/gpu/test_dashboard_gpu.py
#: with DISTRUN_GPU_RECORD, 2026-11-27): the hosts API with NVML's readings and three samples, and
#: the job page's first event, its rank on cuda:0 with the GPU utilisation it sampled.
GPU_RECORDING = Path(__file__).parent / "data" / "gpu_h200"


def test_a_gpu_hosts_recorded_answers_draw_its_gpu_panels(browser, served: Served) -> None:  # noqa: ANN001
    """No GPU here: the page is given the GPU host's recorded answers in place of this machine's, through
    the real dashboard's guard (the token's cookie is the real one). The page's code draws the GPU's
    name, utilisation meter and memory, the GPU use charts, and the rank's device and GPU %."""
    from playwright.sync_api import expect

    hosts = json.loads((GPU_RECORDING / "hosts.json").read_text())
    event = json.loads((GPU_RECORDING / "job_event.json").read_text())
    gpu = hosts["hosts"][0]["server"]["gpus"][0]
    job_id = event["head"]["job"]
    context = browser.new_context()
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.route("**/api/hosts", lambda route: route.fulfill(status=200, content_type="application/json",
                                                            body=json.dumps(hosts)))
    page.route(f"**/api/jobs/{job_id}/events", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body="data: " + json.dumps(event) + "\n\n"))
    page.goto(served.url)
    page.goto(served.origin + "/hosts")
    row = page.get_by_role("table", name="hosts").locator("tbody tr")
    expect(row).to_have_count(1, timeout=15_000)
    expect(row.get_by_role("cell").nth(5)).to_have_text("1 GPU: NVIDIA H200")
    panel = row.get_by_role("list", name="GPUs of localhost")
    used, total = gpu["memory_used_bytes"] / 2**30, gpu["memory_total_bytes"] / 2**30
    expect(panel).to_have_text(re.compile(rf"^0 NVIDIA H200\s+0% · {used:.1f} / {total:.1f} GiB$"))
    expect(panel.locator("meter[aria-label='GPU 0 utilisation']")).to_have_attribute("value", "0")
    for figure in ("GPU %", "GPU memory %"):  # the host's three samples, 0-100
        chart = row.get_by_role("img", name=f"{figure} of localhost", exact=True)
        expect(chart).to_have_attribute("data-points", "3")
    memory = row.get_by_role("img", name="GPU memory % of localhost", exact=True)
    expect(memory.locator("title")).to_have_text(re.compile(r"^GPU memory % of localhost: 1(\.0)? at "))

    page.goto(served.origin + f"/jobs/{job_id}")
    rank = page.get_by_role("table", name="ranks").locator("tbody tr")
    expect(rank).to_have_count(1, timeout=15_000)
    header = page.get_by_role("table", name="ranks").get_by_role("columnheader")
    gpu_column = header.all_inner_texts().index("GPU %")
    expect(rank.get_by_role("cell").nth(2)).to_have_text("cuda:0")
    expect(rank.get_by_role("cell").nth(gpu_column)).to_have_text("0%")
    context.close()
    assert not problems, problems


def test_listening_beyond_loopback_warns_and_sigterm_ends_it(warm_start: None) -> None:
    """`--host` other than loopback says what it exposes; SIGTERM (as Ctrl-C) ends it with nothing left."""
    proc = subprocess.Popen([sys.executable, "-m", "distrun", "dashboard", "--host", "0.0.0.0", "--port", "0",
                             "--no-browser"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("distrun dashboard: http://127.0.0.1:"), line
    served = Served(proc, line.split(": ", 1)[1].strip())
    assert _ask(served, "GET", "/api/hosts")[0] == 401
    status, _, body = _ask(served, "GET", "/api/hosts", {"Authorization": f"Bearer {served.token}"})
    assert status == 200 and json.loads(body)["hosts"][0]["status"] == "up", body[:500]
    port = served.netloc.split(":")[1]  # on every address: this machine's name is its Host too, no other
    named = {"Authorization": f"Bearer {served.token}", "Host": f"{socket.gethostname()}:{port}"}
    assert _ask(served, "GET", "/api/hosts", named)[0] == 200
    assert _ask(served, "GET", "/api/hosts", {**named, "Host": f"attacker.example:{port}"})[0] == 403
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err[-2000:]
    assert err.splitlines()[0].startswith("warning: --host 0.0.0.0: the dashboard listens beyond this machine"), err
    assert "dashboard stopped" in err


def test_the_record_of_clusters_up_keeps_one_entry_a_file_and_forgets_the_gone(tmp_path: Path) -> None:
    """What `up` records and `down` forgets for the dashboard without CLUSTER (no server needed)."""
    from distrun.client.brought_up import RECORD, brought_up, forget, remember

    home, lab, other = tmp_path / "home", tmp_path / "lab.yaml", tmp_path / "other.yaml"
    lab.write_text("x")
    other.write_text("x")
    assert brought_up(str(home)) == ()
    remember(str(home), lab, "lab")
    remember(str(home), other, "other")
    remember(str(home), lab, "lab")  # up again: one entry, renewed (now the newest)
    assert [(entry.name, entry.file) for entry in brought_up(str(home))] == [("other", str(other)), ("lab", str(lab))]
    other.unlink()  # a file that is gone is left out
    assert [entry.name for entry in brought_up(str(home))] == ["lab"]
    forget(str(home), lab)
    assert brought_up(str(home)) == ()
    (home / RECORD).write_text("{not json")  # an unreadable record reads as empty, and is rewritten whole
    assert brought_up(str(home)) == ()
    remember(str(home), lab, "lab")
    assert [entry.name for entry in brought_up(str(home))] == ["lab"]
