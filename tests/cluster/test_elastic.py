"""``--elastic`` on three namespace hosts of one slot each: real sshd, real servers, gloo.

A lost rank costs no step and rejoins; a lost server's host rejoins after ``distrun up``;
below MIN the job falls back to ``--max-restarts``. One cluster serves every test.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests._sshd import cluster_yaml
from tests.cluster.conftest import Lab, brought_up, json_lines, lab_cli, shaped_lab, training_pids
from tests.cluster.test_environment import _wheel
from tests.integration._recipes import ELASTIC
from tests.integration.test_tensorboard import read as read_board

STEPS = 60


@pytest.fixture(scope="module")
def elastic_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, Path]]:
    tmp_path = tmp_path_factory.mktemp("elastic")
    with shaped_lab(tmp_path, ("h1", "h2", "h3")) as lab:
        roles = {"h1": {"roles": "[chief, worker]"}, "h2": {"roles": "[worker]"}, "h3": {"roles": "[worker]"}}
        with brought_up(lab, roles, "elastic") as cluster:
            yield lab, cluster


@pytest.fixture(scope="module")
def one_device_at(tmp_path_factory: pytest.TempPathFactory):
    """The ELASTIC recipe's parameters after N one-device steps (each N run once)."""
    found: dict[int, dict[str, torch.Tensor]] = {}

    def parameters(steps: int) -> dict[str, torch.Tensor]:
        if steps not in found:
            folder = tmp_path_factory.mktemp(f"one-device-{steps}")
            recipe = folder / "elastic.py"
            recipe.write_text(ELASTIC)
            result = subprocess.run([sys.executable, "-m", "distrun", "train", str(recipe), "--strategy", "one-device",
                                     "--device", "cpu", "--steps", str(steps), "--checkpoint-dir", str(folder / "ck"),
                                     "--json"], capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr[-2000:]
            found[steps] = torch.load(latest_checkpoint(folder / "ck"), weights_only=True)["model"]
        return found[steps]

    return parameters


def _recipe(lab: Lab, name: str) -> Path:
    folder = lab.root / name
    folder.mkdir()
    (folder / "elastic.py").write_text(ELASTIC)
    return folder / "elastic.py"


def _no_training_processes(lab: Lab, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while training_pids(lab):
        assert time.monotonic() < deadline, f"training processes left: {training_pids(lab)}"
        time.sleep(0.1)


def test_a_killed_rank_costs_no_step_and_rejoins(elastic_lab, one_device_at) -> None:
    lab, cluster = elastic_lab
    recipe = _recipe(lab, "killed-rank")
    # 0.15 s a step: the 50 steps after the kill last 7-8 s, time for the rank started again to rejoin
    # (on a slow machine its start took 2.3 s, and at 0.05 s a step the job ended 2.6 s later, alone).
    result = lab_cli(lab, "train", str(recipe), "--cluster", str(cluster), "--elastic", "2:3", "--json",
                     "--steps", str(STEPS), "--checkpoint-dir", str(lab.root / "killed-rank-ck"),
                     "--tensorboard", str(lab.root / "killed-rank-tb"), "--",
                     "--die-rank", "2", "--die-at", "10", "--once", str(recipe.parent / "once"), "--sleep-s", "0.15",
                     timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = json_lines(result)
    h3 = lab.hosts["h3"][1]
    changes = [line for line in lines if line["type"] == "membership"]
    assert [c["world_size"] for c in changes] == [2, 3], changes
    assert changes[0]["left"] == [f"rank 2 on {h3} (killed by SIGKILL)"] and changes[1]["joined"] == [f"rank 2 on {h3}"]
    summary = next(line for line in lines if line["type"] == "summary")
    assert summary["steps"] == STEPS and summary["steps_lost"] == 0 and summary["restarts"] == 0
    assert summary["membership_changes"] == 2 and summary["world_size"] == 3
    # The chief's checkpoint came home with the results: one-device's parameters.
    results = next(line for line in lines if line["type"] == "results")
    model = torch.load(results["checkpoint"], weights_only=True)["model"]
    for key, tensor in one_device_at(STEPS).items():
        torch.testing.assert_close(model[key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    # --tensorboard on a cluster: written on the chief's host, home with the results.
    assert results["tensorboard"] == str(lab.root / "killed-rank-tb")
    board = read_board(lab.root / "killed-rank-tb")
    assert [size for _, size in board["membership/world_size"]] == [2, 3]
    assert board["train/loss"][-1][0] == STEPS
    # ... and with `distrun pull`, later: into DIR/<job>/tensorboard.
    job_id = next(line["job"] for line in lines if line["type"] == "job")
    pulled = lab_cli(lab, "pull", job_id, "--cluster", str(cluster), "--to", str(lab.root / "pulled"))
    assert pulled.returncode == 0, pulled.stderr
    assert read_board(lab.root / "pulled" / job_id / "tensorboard")["train/loss"] == board["train/loss"]
    _no_training_processes(lab)


class _Job:
    """A `distrun train --json` in the lab's client namespace, read as it runs (a thread reads its
    output, so a job that goes quiet fails ``read_until`` at its deadline rather than blocking it)."""

    def __init__(self, lab: Lab, *args: str) -> None:
        self._log = lab.root / f"job-{time.monotonic_ns()}.jsonl"  # everything it said, kept for a failure
        self.proc = subprocess.Popen(["ip", "netns", "exec", lab.client_ns, sys.executable, "-m", "distrun", "train",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=lab.root)
        self.lines: list[dict] = []
        self.stderr: list[str] = []
        self._fresh: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()  # type: ignore[arg-type]
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            if raw.startswith("{"):
                self._fresh.put(json.loads(raw))
        self._fresh.put(None)

    def read_until(self, predicate, within_s: float, what: str) -> None:
        deadline = time.monotonic() + within_s
        while True:
            try:
                line = self._fresh.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                said = [x for x in self.lines if x["type"] == "membership"
                        or (x["type"] == "output" and x["line"].startswith("[distrun]"))]
                self._log.write_text("".join(json.dumps(x) + "\n" for x in self.lines) + "".join(self.stderr))
                raise AssertionError(f"{what} did not happen within {within_s} s (all it said: {self._log}); "
                                     f"the job said: {said[-10:]} "
                                     f"{''.join(self.stderr)[-2000:]}") from None
            if line is None:
                self._log.write_text("".join(json.dumps(x) + "\n" for x in self.lines) + "".join(self.stderr))
                raise AssertionError(f"the job ended before {what} (all it said: {self._log}): "
                                     f"{''.join(self.stderr)[-3000:]}")
            self.lines.append(line)
            if predicate(line):
                return


def test_a_lost_server_host_rejoins_after_up(elastic_lab) -> None:
    lab, cluster = elastic_lab
    recipe = _recipe(lab, "lost-server")
    job = _Job(lab, str(recipe), "--cluster", str(cluster), "--elastic", "2:3", "--json", "--steps", "300", "--",
               "--sleep-s", "0.05")
    proc, lines, stderr, read_until = job.proc, job.lines, job.stderr, job.read_until
    try:
        read_until(lambda line: line["type"] == "step" and line["step"] >= 10, 90, "step 10")
        h3_state = lab.workdir / "elastic" / lab.hosts["h3"][1] / "server.json"
        os.kill(json.loads(h3_state.read_text())["pid"], signal.SIGKILL)
        read_until(lambda line: line["type"] == "membership" and line["world_size"] == 2, 30, "a group of 2")
        assert lines[-1]["left"] == [f"rank 2 on {lab.hosts['h3'][1]} (its beat stopped: its host or launcher is gone)"]
        jobs = lab_cli(lab, "jobs", "--cluster", str(cluster), "--json")
        assert jobs.returncode == 0, jobs.stderr
        row = json.loads(jobs.stdout.splitlines()[0])
        assert row["state"] == "running" and row["world_size"] == 3 and row["world_now"] == 2, row
        assert f"note: not listed: {lab.hosts['h3'][1]}" in jobs.stderr  # its server is down
        up = lab_cli(lab, "up", str(cluster), "--json")
        assert up.returncode == 0, up.stdout + up.stderr
        read_until(lambda line: line["type"] == "membership" and line["world_size"] == 3, 60, "a group of 3 again")
        read_until(lambda line: line["type"] == "summary", 120, "the summary")
        proc.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    assert proc.returncode == 0, "".join(stderr)[-3000:]
    summary = next(line for line in lines if line["type"] == "summary")
    assert summary["status"] == "succeeded" and summary["steps"] == 300 and summary["steps_lost"] == 0
    assert summary["membership_changes"] == 2 and summary["world_size"] == 3
    h3 = lab.hosts["h3"][1]
    notes = [line["line"] for line in lines if line["type"] == "output"]
    assert any(note.startswith(f"[distrun] lost {h3}") for note in notes), notes
    assert any(note == f"[distrun] {h3} is back: its ranks join the job" for note in notes), notes
    _no_training_processes(lab)


def test_below_the_minimum_it_falls_back_to_a_restart_from_the_checkpoint(elastic_lab) -> None:
    lab, cluster = elastic_lab
    recipe = _recipe(lab, "below-min")
    result = lab_cli(lab, "train", str(recipe), "--cluster", str(cluster), "--elastic", "3", "--max-restarts", "1",
                     "--json", "--steps", str(STEPS), "--checkpoint-dir", str(lab.root / "below-min-ck"),
                     "--checkpoint-every", "5", "--", "--die-rank", "1", "--die-at", "12",
                     "--once", str(recipe.parent / "once"), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = json_lines(result)
    notes = [line["line"] for line in lines if line["type"] == "output"]
    restart = [note for note in notes if note.startswith("[distrun] restarting every rank (1/1) from the newest "
                                                         "checkpoint after rank")]
    assert restart and "2 replica(s) left, fewer than --elastic MIN 3" in restart[0], notes
    summary = next(line for line in lines if line["type"] == "summary")
    assert summary["restarts"] == 1 and summary["steps"] == STEPS
    _no_training_processes(lab)


def test_a_hung_rank_is_killed_as_lost_by_its_server(elastic_lab) -> None:
    lab, cluster = elastic_lab
    recipe = _recipe(lab, "hung-rank")
    result = lab_cli(lab, "train", str(recipe), "--cluster", str(cluster), "--elastic", "2:3", "--json",
                     "--steps", str(STEPS), "--hang-timeout-s", "3", "--",
                     "--hang-rank", "1", "--die-at", "10", "--once", str(recipe.parent / "once"), "--sleep-s", "0.05",
                     timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = json_lines(result)
    assert [line["rank"] for line in lines if line["type"] == "hang"][:1] == [1]
    notes = [line["line"] for line in lines if line["type"] == "output"]
    assert any(note.startswith("[distrun] rank 1 lost (hung for") for note in notes), notes
    summary = next(line for line in lines if line["type"] == "summary")
    assert summary["steps"] == STEPS and summary["steps_lost"] == 0 and summary["membership_changes"] >= 1
    _no_training_processes(lab)


#: The grow test's recipe imports a package only the job's ``--requirements`` brings (issue 49):
#: a joining host's ranks must get the job's layer too, or their import fails and they never join.
_JOB_PACKAGE = """
import os as _os
import jobpkg
print(f"jobpkg {jobpkg.VALUE} rank {_os.environ.get('RANK')} {jobpkg.__file__}", flush=True)
"""


def test_a_worker_host_added_to_the_cluster_file_joins_up_to_max(elastic_lab) -> None:
    lab, _ = elastic_lab
    recipe = _recipe(lab, "grow")
    recipe.write_text(_JOB_PACKAGE + ELASTIC)
    _wheel(lab.root / "grow-src", "jobpkg", "1.0", "VALUE = 7\n", lab.root / "grow-wheels")
    requirements = lab.root / "grow-requirements.txt"
    requirements.write_text("jobpkg==1.0\n")
    grow = lab.root / "grow.yaml"
    hosts = [{"address": lab.hosts["h1"][1], "roles": "[chief, worker]"}, {"address": lab.hosts["h2"][1]}]
    offline = "wheels: grow-wheels\nindex: false"  # no index in the lab: the wheel comes from the client
    grow.write_text(cluster_yaml(lab.keys, hosts, workdir=lab.workdir, name="grow", extra=offline))
    up = lab_cli(lab, "up", str(grow))
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        job = _Job(lab, str(recipe), "--cluster", str(grow), "--elastic", "1:3", "--json", "--steps", "300",
                   "--requirements", str(requirements), "--", "--sleep-s", "0.05")
        try:
            job.read_until(lambda line: line["type"] == "step" and line["step"] >= 10, 90, "step 10")
            h3 = lab.hosts["h3"][1]
            grow.write_text(cluster_yaml(lab.keys, [*hosts, {"address": h3}], workdir=lab.workdir, name="grow",
                                         extra=offline))
            up = lab_cli(lab, "up", str(grow))
            assert up.returncode == 0, up.stdout + up.stderr
            job.read_until(lambda line: line["type"] == "membership" and line["world_size"] == 3, 60, "a group of 3")
            job.read_until(lambda line: line["type"] == "summary", 120, "the summary")
            job.proc.wait(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                job.proc.kill()
        assert job.proc.returncode == 0, "".join(job.stderr)[-3000:]
        change = next(line for line in job.lines if line["type"] == "membership")
        assert change["joined"] == [f"rank 2 on {h3}"] and change["left"] == []
        summary = job.lines[-1]
        assert summary["steps"] == 300 and summary["world_size"] == 3 and summary["steps_lost"] == 0
        assert any(line["type"] == "output" and line["line"].startswith(f"[distrun] {h3} was added to")
                   for line in job.lines)
        # Every rank, the joiner's too, imported jobpkg from the job's layer (not the hosts' environment).
        imported = {said[3]: said[4] for said in (line["line"].split() for line in job.lines
                                                  if line["type"] == "output" and line["line"].startswith("jobpkg "))}
        assert sorted(imported) == ["0", "1", "2"], job.lines[-20:]
        assert all(path.startswith(str(lab.workdir / ".envs")) for path in imported.values()), imported
    finally:
        lab_cli(lab, "down", str(grow))
    _no_training_processes(lab)


def _diloco_holds_across_a_partition(elastic_lab, link_down_s: float) -> None:
    """diloco --elastic 2:3 on three hosts; h3's link goes down for ``link_down_s`` mid-run. The
    others find it gone at a sync and go on; it is fenced out while cut off, and once its link is
    back it rejoins at a sync: on its own store connection (TCP's retransmission reaches the store),
    cut off and started again as a joiner where that connection broke, or submitted again where its
    server cancelled the job nobody followed. Every outer step is taken once and none is lost."""
    lab, cluster = elastic_lab
    recipe = _recipe(lab, f"diloco-link-{link_down_s:.0f}")
    every = 10
    steps = 400 + int(link_down_s * 14 // every * every)  # ~14 steps a second while h3 is gone
    job = _Job(lab, str(recipe), "--cluster", str(cluster), "--strategy", "diloco", "--elastic", "2:3",
               "--sync-every", str(every), "--steps", str(steps), "--json", "--no-fetch", "--log-interval-s", "0.5",
               "--", "--sleep-s", "0.07")
    try:
        job.read_until(lambda line: line.get("type") == "sync" and line["step"] >= 30, 120, "the sync of step 30")
        _partition(lab, "h3", link_down_s)
        job.read_until(lambda line: line.get("type") == "summary", 240 + link_down_s, "the job's end")
    finally:
        subprocess.run(["ip", "-n", lab.hosts["h3"][0], "link", "set", "eth0", "up"], check=False)
        if job.proc.poll() is None:
            job.proc.kill()
    summary = job.lines[-1]
    assert summary["status"] == "succeeded", "".join(job.stderr)[-3000:]
    changes = [line for line in job.lines if line["type"] == "membership"]
    h3 = lab.hosts["h3"][1]
    assert [c["world_size"] for c in changes] == [2, 3], changes
    assert changes[0]["left"][0].startswith(f"rank 2 on {h3} ("), changes
    assert changes[1]["joined"] == [f"rank 2 on {h3}"] and changes[1]["step"] % every == 0, changes
    notes = [line["line"] for line in job.lines if line["type"] == "output" and line["rank"] == -1]
    assert any(f"{h3} is back" in note for note in notes), notes
    syncs = [line["step"] for line in job.lines if line["type"] == "sync"]
    assert syncs == list(range(every, steps + every, every)), syncs
    assert (summary["steps"], summary["outer_steps"], summary["steps_lost"]) == (steps, steps // every, 0)
    assert summary["membership_changes"] >= 2 and summary["ranks_lost"] == [], summary
    _no_training_processes(lab)


def test_diloco_holds_while_a_hosts_link_is_down_for_8_s(elastic_lab) -> None:
    _diloco_holds_across_a_partition(elastic_lab, 8)


@pytest.mark.bench
@pytest.mark.parametrize("link_down_s", [15, 45])
def test_diloco_holds_across_a_long_partition(elastic_lab, link_down_s) -> None:
    """Issue 52's partitions under diloco (`-m bench`: a 15 s one runs in the suite under multi-worker)."""
    _diloco_holds_across_a_partition(elastic_lab, link_down_s)


# -- chaos: a seeded schedule of faults on the non-chief hosts, one at a time, each tied to a step

CHAOS_KINDS = ("kill", "link", "stop")


def chaos_schedule(seed: int, faults: int, kinds: tuple[str, ...] = CHAOS_KINDS) -> list[tuple[str, str]]:
    """(kind, host) for each fault, from ``seed``: every kind in each round, on h2 or h3; at most
    3 faults a host, whatever their kind: its server starts a lost rank again 3 times, and a
    dropped link loses the rank too (cut off from the store, it is started again). So at
    most 6 faults a run."""
    import random

    if faults > 6:
        raise ValueError("at most 6 faults: 3 respawns on each of h2 and h3")
    rng = random.Random(seed)
    plan: list[tuple[str, str]] = []
    restarts = {"h2": 0, "h3": 0}
    while len(plan) < faults:
        for kind in rng.sample(kinds, len(kinds)):
            hosts = [h for h in ("h2", "h3") if restarts[h] < 3]
            if not hosts:
                break
            host = rng.choice(hosts)
            restarts[host] += 1
            plan.append((kind, host))
    return plan[:faults]


def chaos_long_schedule(seed: int, faults: int) -> list[tuple[str, str, float]]:
    """(kind, host, link seconds) for each fault, from ``seed``: kills, SIGSTOPs and 15-45 s
    partitions on h2 and h3, and a server restart on a host after every 3 of the others there: each
    of those may use one of its launcher's 3 respawns, and a restarted server's launcher has 3 anew."""
    import random

    rng = random.Random(seed)
    plan: list[tuple[str, str, float]] = []
    since_restart = {"h2": 0, "h3": 0}
    while len(plan) < faults:
        host = rng.choice(("h2", "h3"))
        if since_restart[host] == 3:
            plan.append(("server", host, 0.0))
            since_restart[host] = 0
            continue
        kind = rng.choice(CHAOS_KINDS)
        plan.append((kind, host, float(rng.randint(15, 45)) if kind == "link" else 0.0))
        since_restart[host] += 1
    return plan


def chaos_steps(plan: list[tuple[str, str, float]], steps_per_s: float = 30.0) -> int:
    """Steps enough for ``plan``: the job must still run when its last fault is injected (two members
    train on at ``steps_per_s`` while a fault lasts, then the third rejoins), and a margin after."""
    lasts_s = {"kill": 5.0, "stop": 9.0, "server": 15.0, "link": 8.0}
    return int(30 + sum(60 + steps_per_s * (lasts_s[kind] + seconds) for kind, _host, seconds in plan) * 1.3) + 300


def _restart_server(lab: Lab, cluster: Path, job: _Job, host: str) -> None:
    """SIGKILL ``host``'s worker server (its ranks die with it), wait for the group to go on without
    them, then bring it back with ``distrun up``: its ranks are submitted again as joiners."""
    groups = sum(line["type"] == "membership" for line in job.lines)
    state = lab.workdir / "elastic" / lab.hosts[host][1] / "server.json"
    os.kill(json.loads(state.read_text())["pid"], signal.SIGKILL)
    job.read_until(lambda line: line["type"] == "membership" and sum(x["type"] == "membership" for x in job.lines)
                   > groups, 60, f"the group without {host}")
    up = lab_cli(lab, "up", str(cluster), "--json")
    assert up.returncode == 0, up.stdout + up.stderr


def run_chaos(lab: Lab, cluster: Path, one_device_at, *, seed: int, faults: int, steps: int,
              link_down_s: float = 8.0, plan: list[tuple[str, str]] | list[tuple[str, str, float]] | None = None,
              kinds: tuple[str, ...] = CHAOS_KINDS, atol: float = 1e-6) -> str:
    """One ``--elastic 2:3`` multi-worker job while ``chaos_schedule(seed, faults)`` (or ``plan``)
    is injected: a fault once the job passes its step, the next once the group is whole again. A
    plan's entry may give its partition's seconds (else ``link_down_s``). The job must end with
    one-device's parameters and lose no step. Returns the line for the docs."""
    recipe = _recipe(lab, f"chaos-{seed}-{faults}")
    pids = recipe.parent / "pids"
    pids.mkdir()
    plan = plan or chaos_schedule(seed, faults, kinds)
    job = _Job(lab, str(recipe), "--cluster", str(cluster), "--elastic", "2:3", "--hang-timeout-s", "3",
               "--steps", str(steps), "--json", "--log-interval-s", "0.2", "--checkpoint-dir", str(recipe.parent / "ck"), "--",
               "--sleep-s", "0.03", "--pid-dir", str(pids))
    started = time.monotonic()
    injected: list[tuple[str, str, int]] = []
    survived = 0  # faults after which the group was whole again
    try:
        whole_at = 0  # the step at which the group was last whole again
        for index, (kind, host, *seconds) in enumerate(plan):
            at = max(30 + 60 * index, whole_at + 30)
            job.read_until(lambda line: line["type"] == "step" and line["step"] >= at, 120, f"step {at}")
            rank = list(lab.hosts).index(host)  # one slot a host: h2 runs rank 1, h3 rank 2
            step = job.lines[-1]["step"]
            groups = sum(line["type"] == "membership" for line in job.lines)
            if kind == "kill":
                os.kill(int((pids / str(rank)).read_text()), signal.SIGKILL)
            elif kind == "stop":  # the others go on within a second; its launcher kills it after 5 s stopped
                os.kill(int((pids / str(rank)).read_text()), signal.SIGSTOP)
            elif kind == "server":
                _restart_server(lab, cluster, job, host)
            else:
                _partition(lab, host, seconds[0] if seconds else link_down_s)
            injected.append((kind if kind != "link" else f"link {seconds[0] if seconds else link_down_s:.0f} s",
                             host, step))
            job.read_until(lambda line: line["type"] == "membership" and line["world_size"] == 3
                           and sum(x["type"] == "membership" for x in job.lines) > groups + 1,
                           120, f"the group whole again after {kind} on {host} at step {step}")
            whole_at = job.lines[-1]["step"]
            survived += 1
        job.read_until(lambda line: line["type"] == "summary", max(300.0, steps / 15), "the job's end")
        job.proc.wait(timeout=30)
    finally:
        for _, (ns, _) in lab.hosts.items():
            subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=False)
        if job.proc.poll() is None:
            job.proc.kill()
    summary = job.lines[-1]
    assert summary["status"] == "succeeded", "".join(job.stderr)[-3000:]
    assert summary["steps"] == steps and summary["steps_lost"] == 0 and summary["restarts"] == 0, summary
    results = next(line for line in job.lines if line["type"] == "results")
    model = torch.load(results["checkpoint"], weights_only=True)["model"]
    for key, tensor in one_device_at(steps).items():
        torch.testing.assert_close(model[key], tensor, rtol=1e-5, atol=atol,
                                   msg=lambda text, key=key: f"{key}: {text}")
    line = (f"chaos (seed {seed}): {len(injected)} faults injected ({', '.join(f'{k} {h} @{s}' for k, h, s in injected)}), "
            f"{survived} survived, {summary['steps_lost']} steps lost, {summary['membership_changes']} membership "
            f"changes, {steps} steps in {time.monotonic() - started:.0f} s, one-device's parameters")
    print(line)
    _no_training_processes(lab)
    return line


def test_chaos_killed_stopped_and_a_restarted_servers_ranks_end_in_one_devices_parameters(elastic_lab, one_device_at):
    """Five faults, one at a time, SIGKILLs and SIGSTOPs on h2 and h3 and a server restarted between
    them; a stopped rank is killed as lost by its launcher after 5 s (launch/_stopped) and rejoins.
    Dropped links are the tests' below. The first three are a regression's order: h3's rank is
    killed (its agent marks that start lost), then h3's server is restarted: the new launcher's first
    start of rank 2 must not read as the lost one. Before, it did (the mark was ``lost/RANK/N`` with N
    counted per launcher), so when h2's rank was killed next, the chief closed its round without the
    live rank 2 and the job failed ``BelowMinimum`` (issue 52's chaos run, at its 12th fault). Now a
    start is named by its launcher's pid and start time too. (One job for both, where two ran before:
    the suite's time.)"""
    lab, cluster = elastic_lab
    run_chaos(lab, cluster, one_device_at, seed=33, faults=5, steps=800,
              plan=[("kill", "h3"), ("server", "h3"), ("kill", "h2"), ("stop", "h3"), ("stop", "h2")])


def _partition(lab: Lab, host: str, seconds: float) -> None:
    """``host``'s link down for ``seconds``, then up again."""
    ns = lab.hosts[host][0]
    subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)
    try:
        time.sleep(seconds)
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)


def test_a_15_s_partition_heals_and_a_job_that_ends_during_one_succeeds(elastic_lab, one_device_at):
    """Issue 52, both halves in one ``--elastic 1:3`` job of three hosts:

    - h2's link is down for 15 s from step 30: its rank is fenced out, and comes back healed,
      either on its own store connection or, where that connection broke (seen in 2 runs of 3:
      "Failed to recv, got 0 bytes"), cut off: it leaves and is started again as a joiner;
    - h3's link goes down for 15 s just before the last step: the other two finish every step,
      and h3's rank, back too late, is stopped and named in ``ranks_lost``.

    The job succeeds with one-device's parameters, no step lost, and no C++ frames. Before, the
    first partition ended the job ``failed`` on rank 1's "Broken pipe" (exit 4)."""
    lab, cluster = elastic_lab
    recipe = _recipe(lab, "partition-15")
    steps = 1000
    job = _Job(lab, str(recipe), "--cluster", str(cluster), "--elastic", "1:3", "--steps", str(steps), "--json",
               "--log-interval-s", "0.2", "--checkpoint-dir", str(recipe.parent / "ck"), "--", "--sleep-s", "0.03")
    try:
        job.read_until(lambda line: line["type"] == "step" and line["step"] >= 30, 120, "step 30")
        _partition(lab, "h2", 15)
        job.read_until(lambda line: line["type"] == "membership" and line["world_size"] == 3, 120,
                       "h2's rank back in the group")
        rejoined_at = job.lines[-1]["step"]
        assert rejoined_at < steps - 150, f"the job must run on after the rejoin (step {rejoined_at})"
        job.read_until(lambda line: line["type"] == "step" and line["step"] >= steps - 45, 120, "the last steps")
        _partition(lab, "h3", 15)
        job.read_until(lambda line: line["type"] == "summary", 120, "the job's end")
        job.proc.wait(timeout=30)
    finally:
        for ns, _address in lab.hosts.values():
            subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=False)
        if job.proc.poll() is None:
            job.proc.kill()
    stderr = "".join(job.stderr)
    summary = job.lines[-1]
    assert job.proc.returncode == 0 and summary["status"] == "succeeded", stderr[-3000:]
    assert summary["steps"] == steps and summary["steps_lost"] == 0 and summary["restarts"] == 0, summary
    assert summary["ranks_lost"] == [2] and summary["membership_changes"] >= 3, summary  # h2 left, back; h3 left
    changes = [line for line in job.lines if line["type"] == "membership"]
    h2 = lab.hosts["h2"][1]
    assert changes[1]["joined"] == [f"rank 1 on {h2}"], changes
    notes = [line["line"] for line in job.lines if line["type"] == "output"]
    # h3 is lost: its server silent while the others finish (seen most), stopped once they did, or
    # (its link back first) its ranks failed on connections to a store that is gone; lost each way,
    # never the job's failure.
    h3 = lab.hosts["h3"][1]
    assert any(f"lost {h3} (" in note or f"the job finished every step without {h3}" in note
               or f"{h3}'s ranks lost the job" in note for note in notes), "\n".join(notes[-20:])
    assert "frame #" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    results = next(line for line in job.lines if line["type"] == "results")
    model = torch.load(results["checkpoint"], weights_only=True)["model"]
    for key, tensor in one_device_at(steps).items():
        torch.testing.assert_close(model[key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    # h3's ranks, where its server was silent as the job ended, are its server's to stop: once its
    # link is back, it sees no one follows the job, and cancels it after its 10 s lease.
    _no_training_processes(lab, within_s=40)


@pytest.mark.bench
def test_multi_worker_heals_after_a_45_s_partition(elastic_lab, one_device_at):
    """Issue 52's longest partition under multi-worker (`-m bench`; the suite runs a 15 s one above):
    h2's rank is cut off, or its server cancels the job nobody followed; either way it is back in
    the group, and the job ends with one-device's parameters and no step lost."""
    lab, cluster = elastic_lab
    run_chaos(lab, cluster, one_device_at, seed=1, faults=1, steps=30 + 45 * 30 + 300, link_down_s=45,
              plan=[("link", "h2")])


@pytest.mark.bench
@pytest.mark.timeout(3600)
def test_chaos_twenty_faults(elastic_lab, one_device_at):
    """The documented figure for issue 52: DISTRUN_CHAOS_FAULTS faults (default 20) of every kind,
    15-45 s partitions and server restarts among them, seed DISTRUN_CHAOS_SEED (52)."""
    lab, cluster = elastic_lab
    plan = chaos_long_schedule(int(os.environ.get("DISTRUN_CHAOS_SEED", "52")),
                               int(os.environ.get("DISTRUN_CHAOS_FAULTS", "20")))
    # atol: 15,000 steps whose all-reduces sum in another order at each group size leave fp32 noise
    # (measured: 1.3e-5 at most, on weights up to 9); a step lost or taken twice moves them ~1e-2.
    run_chaos(lab, cluster, one_device_at, seed=int(os.environ.get("DISTRUN_CHAOS_SEED", "52")), faults=len(plan),
              steps=chaos_steps(plan), plan=plan, atol=1e-4)


@pytest.mark.bench
def test_chaos_long(elastic_lab, one_device_at):
    """The documented figure: DISTRUN_CHAOS_FAULTS faults (default 6, the most the respawns allow) of every kind, seed
    DISTRUN_CHAOS_SEED (33)."""
    lab, cluster = elastic_lab
    faults = int(os.environ.get("DISTRUN_CHAOS_FAULTS", "6"))
    seed = int(os.environ.get("DISTRUN_CHAOS_SEED", "33"))
    links = sum(kind == "link" for kind, _ in chaos_schedule(seed, faults))
    # Two members train on through a 12 s cut at about 30 steps a second: room for it, so the
    # job does not end before the next fault.
    run_chaos(lab, cluster, one_device_at, seed=seed, faults=faults, steps=30 + 60 * faults + 450 * links + 200,
              link_down_s=12)


