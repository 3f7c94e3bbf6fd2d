"""Warm local start: with `distrun up` (no file) running, `distrun train` forks its ranks from
the embedded server's warm interpreter; everything else is the cold local job's.

One real local server (its own DISTRUN_HOME) is shared by the module; the last test
stops it with `distrun down` under a running job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.conftest import REPO, local_server, run_cli
from tests.integration._recipes import EQUIV, SLOW

pytestmark = pytest.mark.integration

# What a rank sees of its interpreter: the parts a fork of a warm one could get wrong.
PROBE = """
import json, os, signal, sys
import torch
print("PROBE " + json.dumps({
    "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
    "cwd": os.getcwd(), "path0": sys.path[0], "extra": os.environ.get("PROBE_EXTRA"),
    "on_path": any(p.endswith("probe_lib") for p in sys.path), "argv": sys.argv[1:],
    "rank": os.environ["RANK"], "sigpipe": str(signal.getsignal(signal.SIGPIPE)),
}), flush=True)
"""


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A running embedded server whose warm interpreter is ready; its env for run_cli."""
    with local_server(tmp_path_factory.mktemp("distrun-home")) as env:
        yield env


def _summary(stdout: str) -> dict:
    last = json.loads(stdout.strip().splitlines()[-1])
    assert last["type"] == "summary", stdout[-2000:]
    return last


def test_a_warm_run_matches_a_cold_run_exactly(home: dict[str, str], tmp_path: Path) -> None:
    recipe = tmp_path / "equiv.py"
    recipe.write_text(EQUIV)
    runs = {}
    for mode in ("warm", "cold"):
        flags = ["--cold"] if mode == "cold" else []
        result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "12", "--json",
                         "--checkpoint-dir", str(tmp_path / mode), *flags, env=home)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[mode] = _summary(result.stdout)
        first = json.loads(result.stdout.splitlines()[0])  # listed on the local server, warm or --cold
        assert first["type"] == "job" and _listed(home, first["job"])["state"] == "succeeded", first
    assert runs["warm"]["warm"] is True and runs["cold"]["warm"] is False
    assert runs["warm"]["final_loss"] == runs["cold"]["final_loss"]
    warm = torch.load(latest_checkpoint(tmp_path / "warm"), weights_only=True)
    cold = torch.load(latest_checkpoint(tmp_path / "cold"), weights_only=True)
    assert warm["step"] == cold["step"] == 12
    for key, tensor in cold["model"].items():
        assert torch.equal(warm["model"][key], tensor), key


NET_PROBE = """
import os
import torch.distributed as dist
dist.init_process_group("gloo")
print("NET", os.stat("/proc/self/ns/net").st_ino, flush=True)
dist.barrier()
"""


def test_a_warm_jobs_ranks_share_a_network_of_their_own(home: dict[str, str], tmp_path: Path) -> None:
    """Forked by the warm interpreter, the ranks join the job's private network as cold ones do
    (docs/security.md#co-tenants): one namespace for both, not the machine's."""
    recipe = tmp_path / "net.py"
    recipe.write_text(NET_PROBE)
    result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--json", env=home)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _summary(result.stdout)["warm"] is True
    seen = {int(line["line"].split()[1]) for line in map(json.loads, result.stdout.splitlines())
            if line["type"] == "output" and line["line"].startswith("NET ")}
    assert len(seen) == 1 and os.stat("/proc/self/ns/net").st_ino not in seen, seen


def test_a_warm_rank_sees_the_interpreter_a_cold_one_would(home: dict[str, str], tmp_path: Path) -> None:
    """Thread pool, folder, sys.path, environment and signal dispositions are a fresh
    interpreter's, from this client, not the server's."""
    (tmp_path / "probe_lib").mkdir()
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**home, "PROBE_EXTRA": "from the client", "PYTHONPATH": str(tmp_path / "probe_lib")}
    seen = {}
    for mode in ("warm", "cold"):
        flags = ["--cold"] if mode == "cold" else []
        proc = subprocess.run([sys.executable, "-m", "distrun", "train", str(script), "-s", "mirrored",
                               "--replicas", "2", "--json", *flags, "--", "--flag", "x"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, **env}, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _summary(proc.stdout)["warm"] is (mode == "warm")
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        probes = [json.loads(e["line"].split(" ", 1)[1]) for e in lines
                  if e.get("type") == "output" and e["line"].startswith("PROBE ")]
        seen[mode] = sorted(probes, key=lambda probe: probe["rank"])
    assert len(seen["warm"]) == 2
    assert seen["warm"] == seen["cold"]
    first = seen["warm"][0]
    assert first["threads"] == int(first["omp"]) and first["cwd"] == str(tmp_path) == first["path0"]
    assert first["extra"] == "from the client" and first["on_path"] and first["argv"] == ["--flag", "x"]


def _start_slow(home: dict[str, str], tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """A warm mirrored job in the training loop; its ranks' pids (from their Started events)."""
    proc, pids, _job = _start_listed(home, tmp_path)
    return proc, pids


def _start_listed(home: dict[str, str], tmp_path: Path) -> tuple[subprocess.Popen[str], list[int], str]:
    """``_start_slow``, and the job's id on the local server (its --json stream's first line)."""
    recipe = tmp_path / "slow.py"
    recipe.write_text('print("hello from the recipe", flush=True)\n' + SLOW)
    proc = subprocess.Popen([sys.executable, "-m", "distrun", "train", str(recipe), "-s", "mirrored",
                             "--replicas", "2", "--epochs", "50", "--json", "--log-interval-s", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, **home})
    assert proc.stdout is not None
    pids: dict[int, int] = {}
    stepped: set[int] = set()
    job = ""
    deadline = time.monotonic() + 60
    while len(stepped) < 2:
        assert time.monotonic() < deadline, "the warm job did not reach its training loop"
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-2000:] if proc.stderr else "no output"
        event = json.loads(line)
        if event["type"] == "job":
            assert not pids, "the job line comes first"
            job = event["job"]
        elif event["type"] == "started":
            pids[event["rank"]] = event["pid"]
        elif event["type"] == "step":
            stepped.add(event["rank"])
    assert job.startswith("local-"), "a local job is listed on the local server while `distrun up` runs"
    return proc, list(pids.values()), job


def _listed(home: dict[str, str], job: str) -> dict:
    listed = run_cli("jobs", "--json", env=home)
    assert listed.returncode == 0, listed.stderr[-2000:]
    rows = {row["job"]: row for row in map(json.loads, listed.stdout.splitlines())}
    assert job in rows, f"{job} is not listed: {sorted(rows)}"
    return rows[job]


def test_a_local_job_is_listed_followed_stacked_and_cancelled(home: dict[str, str], tmp_path: Path) -> None:
    """Issue 36: from another terminal, `distrun jobs`, `logs`, `stacks` and `cancel` reach a
    local job as they reach a cluster job."""
    proc, pids, job = _start_listed(home, tmp_path)
    row = _listed(home, job)
    assert (row["state"], row["recipe"], row["strategy"], row["world_size"], row["hosts"]) == \
        ("running", "slow.py", "mirrored", 2, ["localhost"])
    logs = run_cli("logs", job, env=home)
    assert logs.returncode == 0 and "ranks 0-1: hello from the recipe" in logs.stdout, logs.stdout + logs.stderr
    found = run_cli("stacks", "--json", env=home)  # no JOB: the one job running here
    assert found.returncode == 0, found.stderr[-2000:]
    stacks = json.loads(found.stdout)
    assert stacks["job"] == job
    assert sorted((stack["rank"], stack["pid"]) for stack in stacks["stacks"]) == sorted(enumerate(pids))
    for stack in stacks["stacks"]:
        assert not stack.get("error") and any("distrun/runtime" in frame["file"] for frame in stack["frames"]), stack
    cancelled = run_cli("cancel", job, env=home)
    assert cancelled.returncode == 0, cancelled.stderr
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: interrupted: stopped 2 replica(s) (cancelled by "), err
    assert _summary(out)["reason"].startswith("cancelled by ")
    _assert_gone(pids)
    row = _listed(home, job)
    assert row["state"] == "stopped" and row["reason"].startswith("cancelled by "), row


def _assert_gone(pids: list[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        assert time.monotonic() < deadline, f"ranks left behind: {alive}"
        time.sleep(0.1)


def test_ctrl_c_stops_a_warm_job_and_exits_130(home: dict[str, str], tmp_path: Path) -> None:
    proc, pids = _start_slow(home, tmp_path)
    server = psutil.Process(json.loads(run_cli("status", "--json", env=home).stdout)["hosts"][0]["server"]["pid"])
    zygote = next(child for child in server.children() if "_zygote" in " ".join(child.cmdline()))
    assert all(psutil.Process(pid).ppid() == zygote.pid for pid in pids), "the ranks were not forked warm"
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: interrupted")
    _assert_gone(pids)
    assert zygote.is_running(), "the warm interpreter stays for the next job"


def test_a_sigkilled_client_leaves_no_warm_rank(home: dict[str, str], tmp_path: Path) -> None:
    """The ranks are the zygote's children, not the client's: the zygote sees the client's
    connection close and kills them."""
    proc, pids, job = _start_listed(home, tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    _assert_gone(pids)
    row = _listed(home, job)  # its server saw its connection close without a result
    assert row["state"] == "lost" and "ended without a result" in row["failure"], row


@pytest.mark.bench
def test_bench_ttfs_here_reports_cold_and_warm_against_torchrun() -> None:
    """The benchmark's shape, and that each contender started as it says (speed is not asserted)."""
    result = run_cli("bench", "ttfs", "--repeats", "1", "--json", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["where"] == "local cpu" and report["world_size"] == 2
    assert [row["name"] for row in report["rows"]] == [
        "torchrun (cold)", "distrun fit (cold)", "distrun fit (warm)", "distrun script (warm)"]
    assert all(0 < row["time_to_first_step_s"] < 120 for row in report["rows"])
    assert not list(Path(tempfile.gettempdir()).glob("distrun-ttfs-*")), "its DISTRUN_HOME is left behind"


def test_distrun_down_stops_a_warm_job_and_leaves_nothing(home: dict[str, str], tmp_path: Path) -> None:
    proc, pids = _start_slow(home, tmp_path)
    down = run_cli("down", "--json", env=home)
    assert down.returncode == 0, down.stderr
    row = json.loads(down.stdout)["hosts"][0]
    assert row["status"] == "stopped" and row["processes_left"] == 0
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 4, err[-2000:]
    assert "its worker server stopped" in err.strip().splitlines()[-1], err[-2000:]
    _assert_gone(pids)
    # With the server gone, the next local job starts cold, silently.
    result = run_cli("train", str(REPO / "recipes" / "linear.py"), "--steps", "2", "--json", env=home)
    assert result.returncode == 0 and _summary(result.stdout)["warm"] is False, result.stderr[-2000:]
    assert "note:" not in result.stderr


def test_a_job_right_after_up_waits_for_the_warm_interpreter(tmp_path: Path) -> None:
    """`status` says up as soon as the server answers, while its zygote still imports torch: a job
    started then waits for it (a few seconds) rather than silently starting cold."""
    env = {"DISTRUN_HOME": str(tmp_path / "home")}
    up = run_cli("up", "--json", env=env)
    assert up.returncode == 0, up.stderr[-2000:]
    try:
        result = run_cli("train", str(REPO / "recipes" / "linear.py"), "--steps", "2", "--json", env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        assert _summary(result.stdout)["warm"] is True and "starting cold" not in result.stderr
    finally:
        run_cli("down", env=env)
