"""Controlling cluster jobs: Ctrl-C, --detach/attach/logs/jobs/cancel, a lost client, a lost server."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from distrun.client.jobs import collapse_ranks
from distrun.protocol.environment import CUT_OFF_EXIT_CODE
from distrun.ui import fmt_ranks
from tests.cluster.conftest import Lab, brought_up, json_lines, lab_cli, module_lab_fixtures, training_pids

SLOW = """
import time
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 8, "epochs": 1000}

def model():
    return nn.Linear(2, 1)

def optimizer(params):
    return torch.optim.SGD(params, lr=0.01)

def loss(outputs, batch):
    time.sleep(0.05)
    return nn.functional.mse_loss(outputs, batch[1])

def train_data(ctx):
    print("loading data", flush=True)
    return TensorDataset(torch.randn(64, 2), torch.randn(64, 1))
"""


# One lab and cluster for the module: a test that kills a server or drops a link restores it before it ends.
_module_lab, lab, cluster = module_lab_fixtures("job-control")


def _wait_until(predicate, within_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > within_s:
            raise AssertionError(f"{what} did not happen within {within_s} s")
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test's ranks end with it. A CI run's attach once hung past its Ctrl-C, its test failed before
    the cancel, and the job it left running failed the four tests after it: now whatever a test leaves
    is killed (until no rank is left: a server may start a lost one again), and a test that left
    training processes running (for 10 s after it) errors."""
    yield
    if "lab" not in request.fixturenames:
        return
    lab = request.getfixturevalue("lab")
    left = 0
    deadline = time.monotonic() + 10
    while pids := training_pids(lab):
        if time.monotonic() > deadline:
            left = max(left, len(pids))
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            assert time.monotonic() < deadline + 30, "training processes kept coming back after SIGKILL"
        time.sleep(0.2)
    assert not left, f"the test left {left} training process(es) running; killed"


def _ended(proc: subprocess.Popen, within_s: float) -> tuple[str, str]:
    """``proc.communicate()``; one still running after ``within_s`` is killed, and the failure shows
    where each of its threads stood (py-spy), which is what a hang on a loaded CI machine needs."""
    try:
        return proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        try:
            dump = subprocess.run([str(Path(sys.executable).with_name("py-spy")), "dump", "--pid", str(proc.pid)],
                                  capture_output=True, text=True, timeout=60, check=False)
            threads = dump.stdout + dump.stderr
        except (OSError, subprocess.SubprocessError) as exc:
            threads = f"(py-spy could not read them: {exc})"
        finally:
            proc.kill()
            _out, err = proc.communicate()
        raise AssertionError(f"distrun {proc.args[7]} still running {within_s:g} s on; its threads:\n{threads}\n"
                             f"its stderr's end:\n{err[-2000:]}") from None


def _start(lab: Lab, *args: str) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", lab.client_ns, sys.executable, "-m", "distrun", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=lab.root)


def _wait_for_steps(proc: subprocess.Popen) -> str:
    """The job's id (its first --json line), once a step was reported."""
    assert proc.stdout is not None
    job_id = ""
    for line in proc.stdout:
        if line.startswith('{"type":"job"'):
            job_id = json.loads(line)["job"]
        if line.startswith('{"type":"step"'):
            return job_id
    raise AssertionError(f"the job never stepped: {proc.stderr.read() if proc.stderr else ''}")


@pytest.fixture
def slow_recipe(tmp_path: Path) -> Path:
    path = tmp_path / "slow" / "slow.py"
    path.parent.mkdir()
    path.write_text(SLOW)
    return path


def test_ctrl_c_cancels_on_every_host(lab: Lab, cluster: Path, slow_recipe: Path) -> None:
    proc = _start(lab, "train", str(slow_recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json")
    _wait_for_steps(proc)
    assert len(training_pids(lab)) == 2
    proc.send_signal(signal.SIGINT)
    _out, err = _ended(proc, 60)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err
    _wait_until(lambda: not training_pids(lab), 10, "every training process ending")


def test_detach_jobs_attach_logs_cancel(lab: Lab, cluster: Path, slow_recipe: Path) -> None:
    started = lab_cli(lab, "train", str(slow_recipe), "--cluster", str(cluster), "--strategy", "multi-worker",
                   "--detach", "--json")
    assert started.returncode == 0, started.stderr
    job_id = json_lines(started)[0]["job"]
    _wait_until(lambda: len(training_pids(lab)) == 2, 30, "both ranks starting")
    time.sleep(12)  # longer than the lease: a detached job is not cancelled for lack of a client
    assert len(training_pids(lab)) == 2

    listed = lab_cli(lab, "jobs", "--cluster", str(cluster), "--json")
    rows = [row for row in json_lines(listed) if row["job"] == job_id]
    assert rows and rows[0]["state"] == "running" and rows[0]["world_size"] == 2 and len(rows[0]["hosts"]) == 2

    logs = lab_cli(lab, "logs", job_id, "--cluster", str(cluster))
    assert logs.returncode == 0, logs.stderr
    assert "ranks 0-1: loading data" in logs.stdout.splitlines()
    one = lab_cli(lab, "logs", job_id, "--cluster", str(cluster), "--rank", "1")
    mine = [line for line in one.stdout.splitlines() if "loading data" in line]
    assert mine == [f"[{lab.hosts['h2'][1]} rank 1] loading data"]
    assert all(line.startswith(f"[{lab.hosts['h2'][1]} rank 1] ") for line in one.stdout.splitlines())

    attach = _start(lab, "attach", job_id, "--cluster", str(cluster), "--json")
    _wait_for_steps(attach)  # replayed from the start, then followed
    attach.send_signal(signal.SIGINT)  # detaches; the job goes on
    _out, err = _ended(attach, 30)
    assert attach.returncode == 130 and "detached from job" in err
    time.sleep(1)
    assert len(training_pids(lab)) == 2

    cancelled = lab_cli(lab, "cancel", job_id, "--cluster", str(cluster))
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stderr
    _wait_until(lambda: not training_pids(lab), 10, "every training process ending after cancel")
    final = [row for row in json_lines(lab_cli(lab, "jobs", "--cluster", str(cluster), "--json")) if row["job"] == job_id]
    assert final[0]["state"] == "stopped"


def _host_log(lab: Lab, host: str, job_id: str, cluster: str = "lab") -> list[dict]:
    """The job's event log on one host, as its server wrote it."""
    path = lab.workdir / cluster / lab.hosts[host][1] / "jobs" / job_id / "events.ndjson"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _job_row(lab: Lab, cluster: Path, job_id: str) -> dict:
    listed = lab_cli(lab, "jobs", "--cluster", str(cluster), "--json")
    assert listed.returncode == 0, listed.stderr
    return next(row for row in json_lines(listed) if row["job"] == job_id)


@pytest.fixture
def hooked(lab: Lab) -> Iterator[Path]:
    """The lab's two hosts as `cluster` has them, with the servers' test hooks on (DR_TEST_HOOKS)."""
    roles = {"h1": {"roles": "[chief, worker]"}, "h2": {"roles": "[worker]"}}
    delay = lab.workdir / "hooked" / lab.hosts["h2"][1] / "test-hook-kill-delay-s"  # set by the test
    with brought_up(lab, roles, "hooked", extra="env: {DR_TEST_HOOKS: '1'}") as path:
        try:
            yield path
        finally:
            delay.unlink(missing_ok=True)  # the module's next test starts without it


@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
def test_a_cancel_reads_stopped_even_when_a_host_is_killed_late(lab: Lab, hooked: Path, slow_recipe: Path,
                                                                elastic: bool) -> None:
    """The interleaving that made the job read `failed`: h2 hears of the cancel 6 s late (a test hook
    on its server), so h1's rank is killed first and h2's rank sees its peer vanish and raises. With a
    single `cancel` per host h2 then recorded `failed`; now every host learnt that the job is stopping
    (the first phase) before any rank died, so h2's death is part of the stop; under --elastic it is
    not a lost replica to start again either."""
    started = lab_cli(lab, "train", str(slow_recipe), "--cluster", str(hooked), "--strategy", "multi-worker",
                      "--detach", "--json", *(["--elastic", "1:2"] if elastic else []))
    assert started.returncode == 0, started.stderr
    job_id = json_lines(started)[0]["job"]
    _wait_until(lambda: any(e.get("type") == "step" for e in _host_log(lab, "h2", job_id, "hooked")), 60, "rank 1 stepping")
    (lab.workdir / "hooked" / lab.hosts["h2"][1] / "test-hook-kill-delay-s").write_text("6")

    asked = time.monotonic()  # before the cancel reaches any host: h2's delayed stop is 6 s from here at least
    cancelled = lab_cli(lab, "cancel", job_id, "--cluster", str(hooked))
    assert cancelled.returncode == 0, cancelled.stderr
    _wait_until(lambda: not training_pids(lab), 20, "every training process ending after cancel")
    took = time.monotonic() - asked
    h2 = _host_log(lab, "h2", job_id, "hooked")
    # The forced interleaving happened: rank 1 ended on its own (its peer vanished) before its kill came:
    # it raised; under --elastic, with the store gone with h1, it was cut off (exit 76, no failure).
    raised = [e["kind"] for e in h2 if e.get("type") == "error" and e["rank"] == 1]
    cut_off = [e for e in h2 if e.get("type") == "exited" and e["rank"] == 1 and e["returncode"] == CUT_OFF_EXIT_CODE]
    assert (raised, bool(cut_off)) == (([], True) if elastic else (["peer-lost"], False)), h2[-5:]
    assert took < 6, "rank 1 ended only at its (delayed) kill: the interleaving was not forced"
    lines = [e.get("line") or "" for host in ("h1", "h2") for e in _host_log(lab, host, job_id, "hooked")]
    assert not [line for line in lines if "starting it again" in line or "goes on without it" in line]

    row = _job_row(lab, hooked, job_id)
    who = f"cancelled by {getpass.getuser()} from {socket.gethostname()}"
    assert (row["state"], row["reason"], row["failure"]) == ("stopped", who, None)
    for host in ("h1", "h2"):
        result = json.loads((lab.workdir / "hooked" / lab.hosts[host][1] / "jobs" / job_id / "result.json").read_text())
        assert (result["state"], result["reason"], result["failure"]) == ("stopped", who, None), host
    table = lab_cli(lab, "jobs", "--cluster", str(hooked))
    assert who in table.stdout, table.stdout

    logs = lab_cli(lab, "logs", job_id, "--cluster", str(hooked))
    assert f"server: [distrun server] stopping: {who}" in logs.stdout.splitlines(), logs.stdout
    attach = lab_cli(lab, "attach", job_id, "--cluster", str(hooked), "--json")
    summary = json_lines(attach)[-1]
    assert attach.returncode == 130 and summary["type"] == "summary" and summary["reason"] == who, attach.stderr
    assert who in attach.stderr.strip().splitlines()[-1]


RAISES_AT_STEP_5_ON_RANK_1 = SLOW.replace('''def loss(outputs, batch):
    time.sleep(0.05)''', '''STEPS = [0]

def loss(outputs, batch):
    import os
    STEPS[0] += 1
    if STEPS[0] == 5 and os.environ["RANK"] == "1":
        raise RuntimeError("boom at step 5")
    if STEPS[0] == 5:
        time.sleep(60)  # rank 0 is still running, alone, when the cancel comes
    time.sleep(0.05)''')


def test_a_rank_that_failed_before_the_cancel_still_reads_failed(lab: Lab, cluster: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "boom" / "boom.py"
    recipe.parent.mkdir()
    recipe.write_text(RAISES_AT_STEP_5_ON_RANK_1)
    started = lab_cli(lab, "train", str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker",
                      "--detach", "--json")
    assert started.returncode == 0, started.stderr
    job_id = json_lines(started)[0]["job"]
    h2_result = lab.workdir / "lab" / lab.hosts["h2"][1] / "jobs" / job_id / "result.json"
    _wait_until(h2_result.exists, 60, "rank 1 failing on h2")
    assert _job_row(lab, cluster, job_id)["state"] == "running"  # rank 0, on h1, is still in its step

    cancelled = lab_cli(lab, "cancel", job_id, "--cluster", str(cluster))
    assert cancelled.returncode == 0, cancelled.stderr
    _wait_until(lambda: not training_pids(lab), 20, "every training process ending after cancel")
    row = _job_row(lab, cluster, job_id)
    assert row["state"] == "failed" and row["reason"] is None
    assert row["failure"].startswith(f"{lab.hosts['h2'][1]}: boom.py:"), row["failure"]
    assert "rank 1 failed at step 5: RuntimeError: boom at step 5" in row["failure"]


def test_a_killed_client_loses_its_lease(lab: Lab, cluster: Path, slow_recipe: Path) -> None:
    proc = _start(lab, "train", str(slow_recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json")
    job_id = _wait_for_steps(proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    killed_at = time.monotonic()
    assert len(training_pids(lab)) == 2  # no client: the servers hold on for the lease...
    _wait_until(lambda: not training_pids(lab), 30, "the servers cancelling the orphaned job")
    assert time.monotonic() - killed_at >= 9  # ...the full lease (10 s) after the client went away
    # The server whose lease ran out first says why, in the job's own log. (The other's ranks
    # may then end on their own, having lost their peer, a moment before its own lease runs out.)
    logs = [log for _ns, address in lab.hosts.values()
            for log in (lab.workdir / "lab" / address / "jobs").glob(f"{job_id}/events.ndjson")]
    assert any("lease expired" in log.read_text() for log in logs)
    def every_host_has_a_result() -> bool:  # and every host's job has ended, with a result
        return all((lab.workdir / "lab" / address / "jobs" / job_id / "result.json").exists()
                   for _ns, address in lab.hosts.values())

    _wait_until(every_host_has_a_result, 10, "every host recording the job's end")


def test_a_killed_worker_server_is_noticed(lab: Lab, cluster: Path, slow_recipe: Path) -> None:
    proc = _start(lab, "train", str(slow_recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json")
    _wait_for_steps(proc)
    h2_server = json.loads((lab.workdir / "lab" / lab.hosts["h2"][1] / "server.json").read_text())["pid"]
    t0 = time.monotonic()
    os.kill(h2_server, signal.SIGKILL)
    try:
        _out, err = _ended(proc, 60)
        assert time.monotonic() - t0 < 15
        assert proc.returncode == 6, err[-2000:]  # a host error: the host, not a rank, was lost
        assert f"error: {lab.hosts['h2'][1]}" in err.strip().splitlines()[-1]
        _wait_until(lambda: not training_pids(lab), 10, "every training process ending")
        assert not psutil.pid_exists(h2_server) or psutil.Process(h2_server).status() == psutil.STATUS_ZOMBIE
    finally:
        restored = lab_cli(lab, "up", str(cluster))  # the module's next tests use the same servers
        assert restored.returncode == 0, restored.stderr


def test_a_dropped_link_is_a_host_error_named_within_15_s(lab: Lab, cluster: Path, slow_recipe: Path) -> None:
    """h2's link goes down mid-run (no RST, no FIN: its packets just stop): the job ends with exit 6
    naming h2 within 15 s, rather than waiting out the stop's calls to the host it cannot reach."""
    proc = _start(lab, "train", str(slow_recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json")
    h2_ns, h2 = lab.hosts["h2"]
    try:
        _wait_for_steps(proc)
        t0 = time.monotonic()
        subprocess.run(["ip", "-n", h2_ns, "link", "set", "eth0", "down"], check=True)
        _out, err = _ended(proc, 90)
        took_s = time.monotonic() - t0
    finally:
        subprocess.run(["ip", "-n", h2_ns, "link", "set", "eth0", "up"], check=False)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 6, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(f"error: {h2}: the worker server went silent"), err[-2000:]
    assert took_s < 15, f"{took_s:.1f} s"
    # h2's server, back on the link, lets go of the job when its lease runs out (the client is gone).
    _wait_until(lambda: not training_pids(lab), 30, "h2's rank ending after the lease")


def test_identical_lines_collapse_per_occurrence() -> None:
    lines = [(0, "epoch 1"), (1, "epoch 1"), (2, "epoch 1"), (3, "epoch 1"), (2, "only two"), (0, "epoch 1"),
             (1, "epoch 1"), (4, "epoch 1")]
    assert [(fmt_ranks(ranks), text) for ranks, text in collapse_ranks(lines)] == [
        ("ranks 0-4", "epoch 1"), ("rank 2", "only two"), ("ranks 0-1", "epoch 1")]
    assert fmt_ranks((0, 1, 4, 6, 7)) == "ranks 0-1,4,6-7"


CHECKPOINTED = SLOW.replace('defaults = {"global_batch_size": 8, "epochs": 1000}', 'defaults = {"global_batch_size": 8}')


@pytest.mark.parametrize("max_restarts", [0, 1])
def test_a_killed_rank_fails_the_job_or_restarts_it_from_the_checkpoint(lab: Lab, cluster: Path, tmp_path: Path,
                                                                        max_restarts: int) -> None:
    recipe = tmp_path / "ckpt" / "ckpt.py"
    recipe.parent.mkdir()
    recipe.write_text(CHECKPOINTED)
    proc = _start(lab, "train", str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json",
                  "--steps", "60", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "10",
                  "--max-restarts", str(max_restarts))
    assert proc.stdout is not None
    job_id = ""
    for line in proc.stdout:  # wait for the first checkpoint, then kill rank 1 (on the second host)
        if line.startswith('{"type":"job"'):
            job_id = json.loads(line)["job"]
        if line.startswith('{"type":"checkpoint"'):
            break
    rank1 = [pid for pid in training_pids(lab) if pid in lab.netns.pids(lab.hosts["h2"][0])]
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGKILL)
    out, err = _ended(proc, 120)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if max_restarts == 0:
        assert proc.returncode == 4, (proc.returncode, out[-3000:], err[-2000:])
        assert err.strip().splitlines()[-1].startswith(f"error: {lab.hosts['h2'][1]}: rank 1 failed")
        assert "SIGKILL" in err.strip().splitlines()[-1]
    else:
        assert proc.returncode == 0, err[-3000:]
        summary = lines[-1]
        assert summary["status"] == "succeeded" and summary["restarts"] == 1 and summary["steps"] == 60
        restarted = [line for line in lines if line.get("type") == "output" and "[distrun] restarting" in line["line"]]
        assert restarted and "from the newest checkpoint" in restarted[0]["line"]
        # The second attempt resumed: its ranks' first steps come after the checkpoint, not from 1.
        restart_at = lines.index(restarted[0])
        second = [line for line in lines[restart_at:] if line.get("type") == "step"]
        assert second and second[0]["step"] > 10
        _the_dashboard_shows_one_run_of_two_attempts(lab, cluster, job_id)
    _wait_until(lambda: not training_pids(lab), 10, "every training process ending")


DASHBOARD_READS = """
import json, sys, time
from pathlib import Path
from distrun.cli.cluster import load_cluster_file
from distrun.dashboard._source import Source
source = Source.of(load_cluster_file(Path(sys.argv[1])))
listed = [job for job in source.jobs()["jobs"] if job["job"].startswith(sys.argv[2])]
watch = source.watch(sys.argv[2])
deadline = time.monotonic() + 60
while not watch.ended and time.monotonic() < deadline:
    time.sleep(0.2)
update = watch.read(None)
print(json.dumps({"listed": listed, "head": update.head, "events": update.events,
                  "steps": [point["step"] for point in update.points]}))
source.close()
"""


def _the_dashboard_shows_one_run_of_two_attempts(lab: Lab, cluster: Path, job_id: str) -> None:
    """The dashboard (issue 50), read as its pages read it: the job and its restart, ``JOB-r1``, are one
    row (the newest attempt's state, 2 attempts), and the job's page follows both attempts, a restart
    event between them, to the second's end."""
    read = subprocess.run(["ip", "netns", "exec", lab.client_ns, sys.executable, "-c", DASHBOARD_READS,
                           str(cluster), job_id], capture_output=True, text=True, timeout=120, cwd=lab.root)
    assert read.returncode == 0, read.stderr[-3000:]
    seen = json.loads(read.stdout.strip().splitlines()[-1])
    assert [(job["job"], job["state"], job["attempts"]) for job in seen["listed"]] == [(job_id, "succeeded", 2)], \
        seen["listed"]
    head = seen["head"]
    assert head["ended"] and head["state"] == "succeeded" and head["attempts"] == 2 and head["step"] == 60, head
    restarts = [event["text"] for event in seen["events"] if event["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0].startswith("restart 1: attempt 1 failed (") \
        and restarts[0].endswith(f"{job_id}-r1 goes on from the newest checkpoint"), seen["events"]
    assert seen["steps"][-1] == 60 and seen["steps"] == sorted(set(seen["steps"])), seen["steps"]


HANGS_ON_RANK_1 = SLOW.replace('''def loss(outputs, batch):
    time.sleep(0.05)''', '''STEPS = [0]

def loss(outputs, batch):
    import os
    STEPS[0] += 1
    if os.environ["RANK"] == "1" and STEPS[0] == 5:
        time.sleep(3600)  # hangs here, alive, in recipe code
    time.sleep(0.05)''')


def test_a_hung_rank_is_named_with_its_stack_and_the_collective_it_never_entered(lab: Lab, tmp_path: Path) -> None:
    """Four ranks on two hosts; rank 1 hangs in the recipe. --hang-timeout-s names it, prints every rank's
    stack (the three waiting ranks collapse into one entry) and brings the Flight Recorder dumps home;
    `distrun stacks` says the same from another client while the job is stuck."""
    recipe = tmp_path / "hang" / "hang.py"
    recipe.parent.mkdir()
    recipe.write_text(HANGS_ON_RANK_1)
    two_each = {"h1": {"roles": "[chief, worker]", "slots": "2"}, "h2": {"roles": "[worker]", "slots": "2"}}
    with brought_up(lab, two_each, "lab4") as cluster:
        proc = _start(lab, "train", str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json",
                      "--hang-timeout-s", "5")
        assert proc.stdout is not None
        hang = found = job = None
        for line in proc.stdout:
            if line.startswith('{"type":"job"'):
                job = json.loads(line)["job"]
            if line.startswith('{"type":"hang"'):
                hang = json.loads(line)
            if line.startswith('{"type":"diagnosis"'):
                found = json.loads(line)
                break
            assert not line.startswith('{"type":"summary"'), "the job ended instead of hanging"
        assert hang is not None and found is not None
        assert hang["rank"] == 1 and hang["waiting"] == [0, 2, 3] and hang["stalled_s"] >= 5
        assert hang["where"].startswith("in recipe hang.py:")
        h1, h2 = lab.hosts["h1"][1], lab.hosts["h2"][1]
        assert {(s["rank"], s["host"]) for s in found["stacks"]} == {(0, h1), (1, h1), (2, h2), (3, h2)}
        by_rank = {s["rank"]: s["frames"] for s in found["stacks"]}
        assert by_rank[0] == by_rank[2] == by_rank[3] and by_rank[1][0]["function"] == "loss"
        assert found["missing"] == [1] and found["awaited"].endswith("gloo:all_reduce")
        home = lab.root / "distrun-results" / job / "debug"
        assert sorted(p.name for p in home.iterdir()) == [f"flight-recorder-rank-{r}.json" for r in range(4)]
        assert found["dump_dir"] == str(home)

        # Another client, while the job is stuck: the one running job, its stacks collapsed across hosts.
        stacks = lab_cli(lab, "stacks", "--cluster", str(cluster))
        assert stacks.returncode == 0, stacks.stderr
        lines = stacks.stdout.splitlines()
        assert any(line.startswith("ranks 0,2-3: ") for line in lines), stacks.stdout
        assert any(line.startswith(f"rank 1 ({h1}): loss (hang.py:") for line in lines), stacks.stdout
        with_fr = lab_cli(lab, "stacks", job, "--cluster", str(cluster), "--json", "--flight-recorder", "fr")
        assert with_fr.returncode == 0, with_fr.stderr
        asked = json_lines(with_fr)[0]
        assert asked["job"] == job and asked["missing"] == [1] and len(asked["stacks"]) == 4
        assert len(list((lab.root / "fr" / job).glob("flight-recorder-rank-*.json"))) == 4

        proc.send_signal(signal.SIGINT)
        _ended(proc, 60)
        assert proc.returncode == 130
        _wait_until(lambda: not training_pids(lab), 10, "every training process ending")
        none_left = lab_cli(lab, "stacks", "--cluster", str(cluster))
        assert none_left.returncode == 2 and "no job is running" in none_left.stderr
