"""A Slurm cluster: `up` asks a real slurmctld for an allocation, srun reaches the nodes, `down` gives it back.

The lab (tests/_slurm.py) runs slurmctld and one slurmd per node in network
namespaces, from Debian's packages; the client runs in a namespace of its own
with only Slurm's commands to reach the nodes (no sshd anywhere here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests._slurm import SlurmLab, require_slurm
from tests._sshd import ClientKeys, NetnsLab, Sshd
from tests.cluster.conftest import distrun_processes, json_lines, kill_all
from tests.conftest import run_cli
from tests.integration._recipes import EQUIV


@dataclass
class Bed:
    slurm: SlurmLab
    client_ns: str
    root: Path
    netns: NetnsLab

    def cli(self, *args: str, timeout: float = 180, ns: str | None = None) -> subprocess.CompletedProcess:
        """`distrun ARGS` in the client namespace (or ``ns``), with the lab's SLURM_CONF."""
        return subprocess.run(["ip", "netns", "exec", ns or self.client_ns, sys.executable, "-m", "distrun", *args],
                              capture_output=True, text=True, timeout=timeout, cwd=self.root, env=self.slurm.env)

    def cluster(self, name: str, nodes: int = 2, extra: str = "") -> Path:
        path = self.root / f"{name}.yaml"
        path.write_text(f"name: {name}\nscheduler: slurm\nslurm: {{nodes: {nodes}{extra}}}\n"
                        f"python: {sys.executable}\nworkdir: '{self.root / 'work'}'\n")
        return path

    def named(self, job_name: str) -> list[str]:
        out = self.slurm.client(self.client_ns, ["squeue", "--noheader", f"--name={job_name}", "--format=%i %T %N"])
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    require_slurm()
    root = tmp_path_factory.mktemp("slurm")
    netns = NetnsLab(f"ds{os.getpid() % 10000}")
    lab = None
    try:
        client_ns, _ = netns.add_node("c", 10)
        lab = SlurmLab(root / "lab", netns, 2)
        yield Bed(lab, client_ns, root, netns)
    finally:
        for job in (lab.jobs() if lab else []):
            lab.client(lab.ctl_ns, ["scancel", job.split()[0]], check=False)
        kill_all(root)
        if lab is not None:
            lab.close()
        netns.close()


@pytest.fixture(scope="module")
def one_device(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The equivalence recipe and the parameters one device ends with."""
    root = tmp_path_factory.mktemp("reference")
    recipe = root / "equiv.py"
    recipe.write_text(EQUIV)
    done = run_cli("train", str(recipe), "--json", "--checkpoint-dir", str(root / "one"), "--epochs", "2",
                   "--", "--samples", "99")
    assert done.returncode == 0, done.stderr[-2000:]
    return recipe, torch.load(latest_checkpoint(root / "one"), weights_only=True)["model"]


def _slow_recipe(folder: Path) -> Path:
    """The equivalence recipe at 0.3 s a step: time to warn it mid-run (the sleep changes no number)."""
    folder.mkdir(exist_ok=True)
    recipe = folder / "equiv.py"
    recipe.write_text(EQUIV.replace("def loss(outputs, batch):", "def loss(outputs, batch):\n    import time; time.sleep(0.3)"))
    return recipe


def _assert_same_model(checkpoint_dir: Path, reference: dict[str, torch.Tensor]) -> None:
    trained = torch.load(latest_checkpoint(checkpoint_dir), weights_only=True)
    assert trained["step"] == 14
    for key, tensor in reference.items():
        torch.testing.assert_close(trained["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def test_up_train_down_on_an_allocation(bed: Bed, one_device: tuple[Path, dict]) -> None:
    cluster = bed.cluster("lab")
    status = bed.cli("status", str(cluster), "--json")
    assert status.returncode == 6 and "no Slurm allocation for cluster 'lab'" in status.stdout

    up = bed.cli("up", str(cluster), "--json")
    assert up.returncode == 0, up.stdout + up.stderr
    rows = json.loads(up.stdout)["hosts"]
    assert [(row["host"], row["status"]) for row in rows] == [("n1", "started"), ("n2", "started")]
    assert rows[0]["roles"] == ["chief", "worker"]
    (job_line,) = bed.named("distrun-lab")
    assert job_line.endswith("RUNNING n[1-2]")
    again = bed.cli("up", str(cluster), "--json")  # idempotent: the allocation and its servers are kept
    assert [row["status"] for row in json.loads(again.stdout)["hosts"]] == ["up", "up"]
    assert bed.named("distrun-lab") == [job_line]

    recipe, reference = one_device
    trained = bed.cli("train", str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json",
                      "--checkpoint-dir", str(bed.root / "mw"), "--epochs", "2", "--", "--samples", "99")
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    lines = json_lines(trained)
    assert lines[0]["hosts"] == ["n1", "n2"] and lines[0]["world_size"] == 2
    _assert_same_model(bed.root / "mw", reference)
    results = next(line for line in lines if line.get("type") == "results")
    assert Path(results["checkpoint"]).read_bytes() == latest_checkpoint(bed.root / "mw").read_bytes()

    # The other commands work unchanged on the allocation's nodes.
    job = lines[0]["job"]
    listed = bed.cli("jobs", "--cluster", str(cluster), "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout.splitlines()[0])["job"] == job, listed.stderr
    logs = bed.cli("logs", job, "--cluster", str(cluster))
    assert logs.returncode == 0 and "rank 1: " in logs.stdout, logs.stdout[-2000:] + logs.stderr  # from n2
    doctor = bed.cli("doctor", str(cluster), "--json")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert [json.loads(line)["host"] for line in doctor.stdout.splitlines()] == ["n1", "n2"]
    pulled = bed.cli("pull", job, "--cluster", str(cluster), "--to", str(bed.root / "pulled"))
    assert pulled.returncode == 0, pulled.stderr
    assert Path(pulled.stdout.strip()).read_bytes() == latest_checkpoint(bed.root / "mw").read_bytes()
    detached = bed.cli("train", str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--detach",
                       "--steps", "100000", "--", "--samples", "99")
    assert detached.returncode == 0, detached.stderr
    running = detached.stdout.strip()
    cancelled = bed.cli("cancel", running, "--cluster", str(cluster))
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = [json.loads(line)["state"] for line in
                  bed.cli("jobs", "--cluster", str(cluster), "--json").stdout.splitlines()
                  if json.loads(line)["job"] == running]
        if states and states[0] != "running":
            break
        time.sleep(0.5)
    assert states == ["stopped"], states
    replay = bed.cli("attach", running, "--cluster", str(cluster), "--json")  # replays the ended job to its end
    summaries = [json.loads(line) for line in replay.stdout.splitlines()
                 if line.startswith("{") and json.loads(line)["type"] == "summary"]
    assert summaries and summaries[-1]["status"] != "succeeded", replay.stdout[-2000:] + replay.stderr[-2000:]

    down = bed.cli("down", str(cluster), "--json")
    assert down.returncode == 0, down.stdout + down.stderr
    rows = json.loads(down.stdout)["hosts"]
    assert [(row["host"], row["status"]) for row in rows] == [("n1", "stopped"), ("n2", "stopped"),
                                                              (f"slurm job {job_line.split()[0]}", "stopped")]
    assert bed.named("distrun-lab") == []
    assert distrun_processes(bed.root) == []
    status = bed.cli("status", str(cluster), "--json")
    assert status.returncode == 6


def test_a_cancelled_allocation_is_named_within_seconds(bed: Bed) -> None:
    cluster = bed.cluster("gone")
    up = bed.cli("up", str(cluster), "--json")
    assert up.returncode == 0, up.stdout + up.stderr
    (job_line,) = bed.named("distrun-gone")
    job_id = job_line.split()[0]
    recipe = bed.root / "slow.py"
    recipe.write_text(EQUIV.replace("def loss(outputs, batch):", "def loss(outputs, batch):\n    import time; time.sleep(0.2)"))
    train = subprocess.Popen(["ip", "netns", "exec", bed.client_ns, sys.executable, "-m", "distrun", "train",
                              str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json",
                              "--epochs", "50"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=bed.root, env=bed.slurm.env)
    try:
        assert train.stdout is not None
        for line in train.stdout:  # wait until the ranks train
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("type") == "step" and event.get("step", 0) >= 3:
                break
        cancelled_at = time.monotonic()
        bed.slurm.client(bed.client_ns, ["scancel", job_id])
        out, err = train.communicate(timeout=60)
        took_s = time.monotonic() - cancelled_at
    finally:
        if train.poll() is None:
            train.kill()
    assert train.returncode == 6, out[-2000:] + err[-2000:]
    error = err.strip().splitlines()[-1]
    assert error.startswith(f"error: slurm: Slurm job {job_id} on n1, n2 ended: CANCELLED"), err[-2000:]
    assert "warning: results not copied home: slurm: the allocation ended" in err  # not a broken pipe
    assert took_s < 5, f"the end of the allocation was named {took_s:.1f} s after scancel"
    time.sleep(3)  # slurmstepd's KillWait
    assert distrun_processes(bed.root) == []


def test_inside_an_allocation_up_uses_it_and_down_leaves_it(bed: Bed, one_device: tuple[Path, dict]) -> None:
    """The user's own sbatch script: SLURM_JOB_ID is set, so `up` asks for nothing and `down` keeps the job."""
    cluster = bed.cluster("mine")
    recipe, reference = one_device
    log = bed.root / "inside.log"
    distrun = f"{sys.executable} -m distrun"
    script = bed.root / "job.sh"
    script.write_text("\n".join([
        "#!/bin/sh",
        f"cd {bed.root}",
        f"{distrun} up {cluster} --json > up.json || exit 1",
        f"{distrun} train {recipe} --cluster {cluster} --strategy multi-worker --json --checkpoint-dir "
        f"{bed.root / 'inside'} --epochs 2 -- --samples 99 > train.json || exit 2",
        f"{distrun} down {cluster} --json > down.json || exit 3",
        "squeue --noheader --jobs=$SLURM_JOB_ID --format=%T > still.txt",
        "squeue --noheader --steps --jobs=$SLURM_JOB_ID --format=%j > steps.txt",
        "",
    ]))
    submitted = bed.slurm.client(bed.client_ns, ["sbatch", "--parsable", "--nodes=2", "--job-name=users-own",
                                                 f"--output={log}", str(script)], cwd=bed.root)
    job_id = submitted.stdout.strip()
    deadline = time.monotonic() + 150
    while bed.named("users-own") and time.monotonic() < deadline:
        time.sleep(1)
    assert not bed.named("users-own"), f"job {job_id} still runs: {log.read_text() if log.exists() else ''}"
    assert log.read_text().strip() == "", log.read_text()
    up = json.loads((bed.root / "up.json").read_text())
    assert [row["host"] for row in up["hosts"]] == ["n1", "n2"]
    assert bed.named("distrun-mine") == []  # no second allocation was asked for
    _assert_same_model(bed.root / "inside", reference)
    down = json.loads((bed.root / "down.json").read_text())
    assert down["hosts"][-1]["host"] == f"slurm job {job_id}" and down["hosts"][-1]["status"] == "not running"
    assert "left running" in down["hosts"][-1]["message"]
    assert (bed.root / "still.txt").read_text().strip() == "RUNNING"
    steps = (bed.root / "steps.txt").read_text().split()
    assert not [step for step in steps if step.startswith("distrun")], steps  # no server or relay step left
    assert not [proc for proc in psutil.process_iter(["cmdline"])
                if "distrun.server" in " ".join(proc.info["cmdline"] or []) and str(bed.root) in
                " ".join(proc.info["cmdline"] or [])]
    assert distrun_processes(bed.root) == []


def test_the_exported_sbatch_script_trains_to_one_devices_parameters(bed: Bed, one_device: tuple[Path, dict]) -> None:
    cluster = bed.cluster("exp", extra=", extra_args: ['--comment=from distrun export']")
    recipe, reference = one_device
    script = bed.root / "exported.sbatch"
    written = run_cli("export", "slurm", str(cluster), str(recipe), "--strategy", "multi-worker", "--epochs", "2",
                      "--checkpoint-dir", "exported-ckpt", "-o", str(script), "--", "--samples", "99")
    assert written.returncode == 0, written.stderr
    text = script.read_text()
    assert "#SBATCH --nodes=2\n" in text and '#SBATCH "--comment=from distrun export"\n' in text
    assert "DISTRUN_JOB_SECRET=" in text and "new_job_secret" in text  # drawn on the cluster, at run time
    submitted = bed.slurm.client(bed.client_ns, ["sbatch", "--parsable", str(script)], check=False, cwd=bed.root)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    deadline = time.monotonic() + 150
    while bed.named("distrun-exp-equiv") and time.monotonic() < deadline:
        time.sleep(1)
    log = bed.root / f"distrun-exp-equiv-{job_id}.out"
    assert not bed.named("distrun-exp-equiv"), log.read_text() if log.exists() else "no log"
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert {event["rank"] for event in events if event["type"] == "started"} == {0, 1}, log.read_text()[-3000:]
    _assert_same_model(bed.root / "exported-ckpt", reference)
    job_dir = bed.root / ".distrun-jobs" / job_id
    assert oct(job_dir.stat().st_mode & 0o777) == "0o700"
    assert distrun_processes(bed.root) == []


def test_from_the_laptop_through_the_login_node(bed: Bed, one_device: tuple[Path, dict]) -> None:
    """The client has no Slurm of its own: every Slurm command runs on the login node over SSH."""
    login_ns, login_address = bed.netns.add_node("login", 9)
    keys = ClientKeys(bed.root / "laptop")
    sshd = Sshd(bed.root / "login-sshd", address=login_address, port=22, netns=login_ns,
                extra_config=f"SetEnv SLURM_CONF={bed.slurm.conf}\n")
    sshd.start(keys.authorized_keys)
    try:
        keys.known_hosts.write_text(sshd.known_hosts_line())
        cluster = bed.root / "laptop.yaml"
        cluster.write_text("\n".join([
            "name: remote", "scheduler: slurm",
            f"slurm: {{nodes: 2, login: {{address: {login_address}}}}}",
            f"ssh: {{user: root, identity_file: {keys.identity}, known_hosts: {keys.known_hosts}, connect_timeout_s: 5}}",
            f"python: {sys.executable}", f"workdir: '{bed.root / 'work'}'", ""]))
        laptop_env = {key: value for key, value in bed.slurm.env.items() if key != "SLURM_CONF"}

        def laptop(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(["ip", "netns", "exec", bed.client_ns, sys.executable, "-m", "distrun", *args],
                                  capture_output=True, text=True, timeout=180, cwd=bed.root, env=laptop_env)

        assert subprocess.run(["ip", "netns", "exec", bed.client_ns, "squeue"], env=laptop_env,
                              capture_output=True).returncode != 0  # no Slurm here: only through the login node
        up = laptop("up", str(cluster), "--json")
        assert up.returncode == 0, up.stdout + up.stderr
        assert [row["host"] for row in json.loads(up.stdout)["hosts"]] == ["n1", "n2"]
        recipe, reference = one_device
        trained = laptop("train", str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json",
                         "--checkpoint-dir", str(bed.root / "laptop-ckpt"), "--epochs", "2", "--", "--samples", "99")
        assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
        _assert_same_model(bed.root / "laptop-ckpt", reference)
        down = laptop("down", str(cluster), "--json")
        assert down.returncode == 0, down.stdout + down.stderr
        assert bed.named("distrun-remote") == []
        assert distrun_processes(bed.root) == []
    finally:
        sshd.stop()


def test_up_waits_for_a_pending_allocation_and_says_why(bed: Bed) -> None:
    """Another job holds every node: `up` shows squeue's reason while it waits. A request nobody
    waits for is withdrawn (SIGTERM to `up`, or `down` meanwhile); the one waited for starts."""
    hog = bed.slurm.client(bed.client_ns, ["sbatch", "--parsable", "--exclusive", "--nodes=2", "--job-name=hog",
                                           "--output=/dev/null", "--wrap=exec sleep 600"]).stdout.strip()
    deadline = time.monotonic() + 30
    while not any(line.endswith("RUNNING n[1-2]") for line in bed.named("hog")) and time.monotonic() < deadline:
        time.sleep(0.2)
    cluster = bed.cluster("waits")

    def pending_up() -> tuple[subprocess.Popen, list[str]]:
        up = subprocess.Popen(["ip", "netns", "exec", bed.client_ns, sys.executable, "-m", "distrun", "up",
                               str(cluster), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=bed.root, env=bed.slurm.env)
        assert up.stderr is not None
        said = []
        for line in up.stderr:
            said.append(line.strip())
            if "pending: Resources" in line:
                break
        assert said[-1].startswith("slurm: job ") and said[-1].endswith(" pending: Resources"), said
        return up, said

    try:
        up, _ = pending_up()  # killed while it waits: the request goes with it
        up.terminate()
        up.communicate(timeout=30)
        assert up.returncode != 0 and bed.named("distrun-waits") == []

        up, _ = pending_up()  # `down` while it waits: the request is withdrawn, `up` says so
        down = bed.cli("down", str(cluster), "--json")
        assert down.returncode == 0, down.stdout + down.stderr
        assert json.loads(down.stdout)["hosts"][-1]["message"].startswith("ended Slurm job ")
        out, err = up.communicate(timeout=30)
        assert up.returncode == 6 and "ended before it started" in err, out + err
        assert bed.named("distrun-waits") == []

        up, _ = pending_up()
        bed.slurm.client(bed.client_ns, ["scancel", hog])
        out, err = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
        bed.slurm.client(bed.client_ns, ["scancel", hog], check=False)
    assert up.returncode == 0, out + err
    assert [row["status"] for row in json.loads(out)["hosts"]] == ["started", "started"]
    down = bed.cli("down", str(cluster), "--json")
    assert down.returncode == 0, down.stdout + down.stderr
    assert bed.named("distrun-waits") == []


def test_a_requeued_job_resumes_from_the_checkpoint_it_wrote_at_slurms_warning(
        bed: Bed, one_device: tuple[Path, dict]) -> None:
    """Slurm warns the batch script (what --signal=B:USR1@N does before the time limit): every rank
    checkpoints at one agreed step and stops, the script requeues the job, and the requeued run
    resumes there and ends with one device's parameters."""
    cluster = bed.cluster("pre")
    _, reference = one_device
    recipe = _slow_recipe(bed.root / "slow")
    script = bed.root / "requeue.sbatch"
    written = run_cli("export", "slurm", str(cluster), str(recipe), "--strategy", "multi-worker", "--epochs", "2",
                      "--checkpoint-dir", "requeue-ckpt", "--requeue", "--grace-s", "60",
                      "-o", str(script), "--", "--samples", "99")
    assert written.returncode == 0, written.stderr
    assert "#SBATCH --requeue\n#SBATCH --signal=B:USR1@60\n" in script.read_text()
    job_id = bed.slurm.client(bed.client_ns, ["sbatch", "--parsable", str(script)], cwd=bed.root).stdout.strip()
    log = bed.root / f"distrun-pre-equiv-{job_id}.out"

    def events() -> list[dict]:
        text = log.read_text() if log.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    deadline = time.monotonic() + 60
    while not any(e["type"] == "step" and e["step"] >= 4 for e in events()) and time.monotonic() < deadline:
        time.sleep(0.1)
    seen = max(e["step"] for e in events() if e["type"] == "step")
    bed.slurm.client(bed.client_ns, ["scancel", "--batch", "--signal=USR1", job_id])
    deadline = time.monotonic() + 150
    while bed.named("distrun-pre-equiv") and time.monotonic() < deadline:
        time.sleep(1)
    assert not bed.named("distrun-pre-equiv"), log.read_text()[-3000:]
    text = log.read_text()
    assert f"requeueing job {job_id}" in text, text[-3000:]
    everything = events()
    saved = [e["step"] for e in everything if e["type"] == "checkpoint"]
    stopped_at = saved[0]
    assert seen <= stopped_at <= seen + 3, (seen, saved)  # the steps between the warning and the stop
    assert saved[-1] == 14
    starts = [e for e in everything if e["type"] == "started"]
    assert len(starts) == 4  # two ranks, twice: the first run and the requeued one
    resumed = [e["step"] for e in everything[everything.index(starts[2]):] if e["type"] == "step"]
    assert resumed[0] == stopped_at + 1, resumed  # no step lost, none done twice
    _assert_same_model(bed.root / "requeue-ckpt", reference)
    assert distrun_processes(bed.root) == []


def test_a_job_on_an_allocation_checkpoints_at_its_warning_and_resumes(
        bed: Bed, one_device: tuple[Path, dict]) -> None:
    """Slurm warns the allocation's steps before its time limit (`--signal=USR1@N`, sent here at
    once with scancel): the servers pass it on, every rank checkpoints at one step and stops,
    the client says where (exit 75), and `--resume` after goes on to one device's parameters."""
    cluster = bed.cluster("warned")
    _, reference = one_device
    recipe = _slow_recipe(bed.root / "slow2")
    up = bed.cli("up", str(cluster), "--json")
    assert up.returncode == 0, up.stdout + up.stderr
    (job_line,) = bed.named("distrun-warned")
    job_id = job_line.split()[0]
    args = [str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json", "--checkpoint-dir",
            str(bed.root / "warned-ckpt"), "--epochs", "2", "--", "--samples", "99"]
    train = subprocess.Popen(["ip", "netns", "exec", bed.client_ns, sys.executable, "-m", "distrun", "train", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=bed.root,
                             env=bed.slurm.env)
    try:
        assert train.stdout is not None
        seen = 0
        for line in train.stdout:
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("type") == "step":
                seen = max(seen, event["step"])
                if seen >= 3:
                    break
        bed.slurm.client(bed.client_ns, ["scancel", "--signal=USR1", job_id])  # every step, not the batch shell
        out, err = train.communicate(timeout=60)
    finally:
        if train.poll() is None:
            train.kill()
    assert train.returncode == 75, out[-2000:] + err[-2000:]
    saved = [json.loads(line)["step"] for line in out.splitlines()
             if line.startswith("{") and json.loads(line)["type"] == "checkpoint"]
    assert saved and seen <= saved[-1] <= seen + 3, (seen, saved)
    assert f"every rank checkpointed at step {saved[-1]}" in err.strip().splitlines()[-1], err[-2000:]
    assert bed.named("distrun-warned") == [job_line]  # the allocation itself goes on to its end

    resumed = bed.cli("train", *args[:-3], "--resume", "--", "--samples", "99")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    first = next(json.loads(line)["step"] for line in resumed.stdout.splitlines()
                 if line.startswith("{") and json.loads(line)["type"] == "step")
    assert first == saved[-1] + 1
    _assert_same_model(bed.root / "warned-ckpt", reference)
    down = bed.cli("down", str(cluster), "--json")
    assert down.returncode == 0, down.stdout + down.stderr
