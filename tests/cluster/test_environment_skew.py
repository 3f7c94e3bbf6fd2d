"""Skew and missing packages named before a job starts, and a job's own ``--requirements`` (issue 49).

Two namespace hosts with real sshd and no package index, as in ``test_environment``: the
cluster's environment holds ``clickutil`` 2.0 (a wheel built here; ``VALUE = 42``). The
client runs with ``clickutil`` 1.0 and ``onlyhere`` on its PYTHONPATH (unpacked wheels, so
their versions are known as an installed package's are), so the hosts' clickutil is skewed
and onlyhere is missing there. ``extrapkg`` is in the wheels folder but in no
``requirements:``: only a job's ``--requirements`` brings it. A refused job must have run
no rank: every rank writes a file, and the output folder stays empty.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.conftest import Lab, cmdline, json_lines, lab_cli, shaped_lab
from tests.cluster.test_environment import _cluster, _env_name, _up, _wheel

RECIPE = """
import os
import clickutil{extra}

def main(strategy):
    out = os.environ["SKEW_OUT"]
    with open(os.path.join(out, f"rank{{strategy.replica_id}}.txt"), "w") as f:
        f.write(f"{{clickutil.VALUE}} {{clickutil.__file__}}")
"""

JOB_RECIPE = """
import os
import extrapkg   # only in the job's own --requirements

def main(strategy):
    with open(os.path.join(os.environ["SKEW_OUT"], f"rank{strategy.replica_id}.txt"), "w") as f:
        f.write(f"{extrapkg.VALUE} {extrapkg.__file__}")
"""

PROBE_RECIPE = """
import os

def main(strategy):
    try:
        import extrapkg
        seen = f"{extrapkg.VALUE} {extrapkg.__file__}"
    except ImportError:
        seen = "absent"
    with open(os.path.join(os.environ["SKEW_OUT"], f"rank{strategy.replica_id}.txt"), "w") as f:
        f.write(seen)
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with shaped_lab(tmp_path_factory.mktemp("skew"), ("h1", "h2")) as made:
        wheels, client_wheels = made.root / "wheels", made.root / "client-wheels"
        for name, version, body, into in [("clickutil", "1.0", "VALUE = 41\n", client_wheels),
                                          ("clickutil", "2.0", "VALUE = 42\n", wheels),
                                          ("onlyhere", "3.0", "VALUE = 3\n", client_wheels),
                                          ("extrapkg", "1.5", "VALUE = 15\n", wheels)]:
            _wheel(made.root / "src", name, version, body, into)
        client = made.root / "client-site"  # the client's own packages: unpacked wheels, dist-info and all
        for wheel in client_wheels.glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(client)
        (made.root / "out").mkdir()
        cluster = _cluster(made, "skew", f"requirements: [clickutil==2.0]\nwheels: wheels\n"
                                         f"env: {{SKEW_OUT: '{made.root / 'out'}'}}")
        up, rows, _ = _up(made, cluster)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        try:
            yield made
        finally:
            lab_cli(made, "down", str(cluster))


def _train(lab: Lab, recipe_text: str, *args: str, name: str = "recipe") -> tuple[subprocess.CompletedProcess, float]:
    """`distrun train` in the client namespace, with the client's own packages on its PYTHONPATH."""
    for old in (lab.root / "out").iterdir():
        old.unlink()
    recipe = lab.root / "code" / f"{name}.py"
    recipe.parent.mkdir(exist_ok=True)
    recipe.write_text(recipe_text)
    env = dict(os.environ, PYTHONPATH=str(lab.root / "client-site"))
    t0 = time.monotonic()
    proc = subprocess.run(["ip", "netns", "exec", lab.client_ns, sys.executable, "-m", "distrun", "train", str(recipe),
                           "--cluster", str(lab.root / "skew.yaml"), "--strategy", "multi-worker", *args],
                          capture_output=True, text=True, timeout=300, cwd=lab.root, env=env)
    return proc, time.monotonic() - t0


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def _ranks_wrote(lab: Lab) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted((lab.root / "out").iterdir())}


def test_a_skewed_package_is_refused_in_one_line_before_any_rank(lab: Lab) -> None:
    proc, wall_s = _train(lab, RECIPE.format(extra=""))
    assert proc.returncode == 6, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = _error_lines(proc)
    assert len(lines) == 1, proc.stderr
    h1, h2 = lab.hosts["h1"][1], lab.hosts["h2"][1]
    assert lines[0] == (f"error: {h1}, {h2}: clickutil 2.0 where the client has 1.0 (add clickutil==1.0 to "
                        "requirements, or --allow-skew)"), lines  # both hosts, one problem, one line
    assert _ranks_wrote(lab) == {}  # no rank ran the recipe
    assert "Traceback" not in proc.stderr
    print(f"refused in {wall_s:.1f} s")


def test_a_missing_package_is_named_with_the_host(lab: Lab) -> None:
    proc, _ = _train(lab, RECIPE.format(extra="\nimport onlyhere"), name="missing")
    assert proc.returncode == 6, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = _error_lines(proc)
    assert len(lines) == 1, proc.stderr
    h1 = lab.hosts["h1"][1]
    assert lines[0].startswith(f"error: {h1}, "), lines
    assert ": the recipe imports onlyhere, which is not installed there (add it to requirements)" in lines[0], lines
    assert _ranks_wrote(lab) == {}
    # --allow-skew lets versions differ, never a package that is not there.
    proc, _ = _train(lab, RECIPE.format(extra="\nimport onlyhere"), "--allow-skew", name="missing")
    assert proc.returncode == 6 and "the recipe imports onlyhere" in proc.stderr, proc.stderr[-3000:]
    assert _ranks_wrote(lab) == {}


def test_allow_skew_lets_it_run_on_the_hosts_version(lab: Lab) -> None:
    proc, _ = _train(lab, RECIPE.format(extra=""), "--allow-skew", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json_lines(proc)[0]["world_size"] == 2
    wrote = _ranks_wrote(lab)
    assert sorted(wrote) == ["rank0.txt", "rank1.txt"]
    assert all(text.startswith("42 ") for text in wrote.values()), wrote  # the hosts' clickutil 2.0


def test_a_jobs_requirements_are_that_jobs_alone(lab: Lab) -> None:
    envs = lab.workdir / ".envs"
    before = {path.name for path in envs.iterdir()}
    # Without the option the recipe's import is found missing before any rank starts.
    proc, _ = _train(lab, JOB_RECIPE, name="job")
    assert proc.returncode == 6 and "the recipe imports extrapkg, which is not installed there" in proc.stderr, \
        proc.stderr[-3000:]
    reqs = lab.root / "job-requirements.txt"
    reqs.write_text("extrapkg==1.5\n")
    proc, first_s = _train(lab, JOB_RECIPE, "--requirements", str(reqs), "--json", name="job")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wrote = _ranks_wrote(lab)
    assert sorted(wrote) == ["rank0.txt", "rank1.txt"]
    layers = {path.name for path in envs.iterdir() if path.is_dir()} - before
    assert len(layers) == 1, layers  # one layer (the hosts share a filesystem), built once
    layer = envs / layers.pop()
    assert all(text.startswith("15 ") and str(layer) in text for text in wrote.values()), wrote
    log = (layer / "install.log").read_text()  # pip's, or uv's where the host has uv (installer: auto)
    assert "Successfully installed extrapkg-1.5" in log or "+ extrapkg==1.5" in log, log
    marker = (layer / ".distrun-ready").stat().st_mtime_ns
    # The next job with the same file reuses the layer: nothing installed again.
    proc, again_s = _train(lab, JOB_RECIPE, "--requirements", str(reqs), name="job")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (layer / ".distrun-ready").stat().st_mtime_ns == marker
    # The next job without it does not see it: the layer was that job's, not the server's.
    proc, _ = _train(lab, PROBE_RECIPE, name="probe")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(_ranks_wrote(lab).values()) == {"absent"}
    print(f"job with its own requirements: {first_s:.1f} s first, {again_s:.1f} s reused")


def test_doctor_shows_each_hosts_environment_beside_the_clients(lab: Lab) -> None:
    _, rows, _ = _up(lab, lab.root / "skew.yaml")  # nothing changed: kept; its rows say the environment's name
    names = {_env_name(row) for row in rows.values()}
    proc = lab_cli(lab, "doctor", str(lab.root / "skew.yaml"), "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doctor = [row for row in json_lines(proc) if row.get("type") == "doctor"]
    assert len(doctor) == 2 and {row["environment"] for row in doctor} == names, doctor
    for row in doctor:
        assert row["python"] == row["client_python"] == platform.python_version(), row
        assert row["torch"] == row["client_torch"] and row["torch"].startswith("2."), row
        # The installer that built the host's environment (installer: auto): uv where the host has it, else pip.
        marker = json.loads((lab.workdir / ".envs" / row["environment"] / ".distrun-ready").read_text())
        assert row["installer"] == marker["installer"] and row["installer"].split()[0] in ("uv", "pip"), row
    table = lab_cli(lab, "doctor", str(lab.root / "skew.yaml"))
    assert table.returncode == 0, table.stdout[-3000:]
    assert f"client: python {platform.python_version()}" in table.stdout and " env " in table.stdout, table.stdout
    assert next(iter(names)) in table.stdout, table.stdout
    assert " installer " in table.stdout and doctor[0]["installer"] in table.stdout, table.stdout


def test_the_skew_rules_and_their_one_line(tmp_path: Path) -> None:
    """What the lab cannot show (one Python, one torch, no GPU): each rule's message, from facts."""
    from distrun.client._skew import HostFacts, _one_line, problems_of, recipe_imports

    torch = {"found": True, "dist": "torch", "cuda": ""}
    client = HostFacts("3.11", "3.11.7", {"torch": {**torch, "version": "2.13.0+cpu"},
                                          "yaml": {"found": True, "dist": "PyYAML", "version": "6.0"},
                                          "clickutil": {"found": False, "dist": None, "version": None}})
    host = HostFacts("3.10", "3.10.12", {"torch": {**torch, "version": "2.12.0+cu124"},
                                         "yaml": {"found": True, "dist": "PyYAML", "version": "5.4"},
                                         "clickutil": {"found": True, "dist": "clickutil", "version": "9"},
                                         "tensorboard": {"found": False}})
    lines = problems_of("gpu-2", host, client, modules=["yaml", "clickutil"], options={"tensorboard": "--tensorboard"},
                        cuda_wanted=True, gpus=4, allow_skew=False)
    assert lines == [
        "gpu-2: Python 3.10.12 where the client has 3.11.7 (set python: to a Python 3.11 there, or --allow-skew)",
        "gpu-2: torch 2.12.0 where the client has 2.13.0 (add torch==2.13.0 to requirements, or --allow-skew)",
        "gpu-2: torch 2.12.0+cu124 was built without CUDA, and the job runs on the host's 4 GPU(s) (install a CUDA "
        "build of torch there, or --allow-skew)",
        "gpu-2: PyYAML 5.4 where the client has 6.0 (add PyYAML==6.0 to requirements, or --allow-skew)",
        "gpu-2: --tensorboard needs tensorboard, which is not installed there (add it to requirements)",
    ]  # clickutil: the client has none, so any version there will do
    assert problems_of("gpu-2", host, client, modules=["yaml"], options={}, cuda_wanted=False, gpus=4,
                       allow_skew=True) == []
    error = _one_line(["a: x", "b: x", "b: y"])
    assert (error.host, str(error)) == ("a, b", "a, b: x; and b: y") and error.exit_code == 6
    recipe = tmp_path / "skew-recipe.py"
    recipe.write_text("import os, numpy.linalg\nfrom helper import f\nfrom . import sib\ntry:\n    import opt\n"
                      "except ImportError:\n    pass\ndef main(s):\n    import inner\n")
    assert recipe_imports(str(recipe), ["skew-recipe.py", "helper.py"]) == ("numpy",)


WAITING_RECIPE = """
import os, time
import extrapkg

def main(strategy):
    out = os.environ["SKEW_OUT"] + "-a"
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(out, "go")) and time.time() < deadline:
        time.sleep(0.2)
    with open(os.path.join(out, f"rank{strategy.replica_id}.txt"), "w") as f:
        f.write(str(extrapkg.VALUE))
"""


def _layers(lab: Lab) -> set[str]:
    return {path.name for path in (lab.workdir / ".envs").iterdir() if (path / ".distrun-ready").exists()}


def _leases(layer: Path) -> dict[str, object]:
    """Each lease on ``layer``: its job folder, and which of its attempts' folders have a result yet."""
    found: dict[str, object] = {}
    for lease in (layer / ".in-use").glob("*"):
        try:
            folder = Path(json.loads(lease.read_text())["folder"])
        except (OSError, ValueError, KeyError) as exc:
            found[lease.name] = repr(exc)
            continue
        attempts = [folder, *folder.parent.glob(folder.name + "-r*")]
        found[lease.name] = (str(folder), {path.name: (path.is_dir(), (path / "result.json").exists())
                                           for path in attempts})
    return found


def _job_requirements(lab: Lab, name: str, line: str) -> Path:
    path = lab.root / f"{name}.txt"
    path.write_text(line + "\n")
    return path


def test_old_environments_go_after_the_newest_few_never_while_a_job_uses_one(lab: Lab) -> None:
    cluster = lab.root / "skew.yaml"
    cluster.write_text(cluster.read_text().replace("wheels: wheels\n", "wheels: wheels\nkeep_environments: 1\n"))
    (lab.root / "out-a").mkdir()
    base = _layers(lab)
    servers = {_env_name(row) for row in _up(lab, cluster)[1].values()}  # kept: keep_environments changes no server
    # Job A runs (detached) on layer 1 until the test says go.
    first = _job_requirements(lab, "first", "extrapkg==1.5")
    proc, _ = _train(lab, WAITING_RECIPE, "--requirements", str(first), "--detach", "--json", name="waits")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job_a = json_lines(proc)[0]["job"]
    layer_1 = _layers(lab) - base
    assert len(layer_1) <= 1  # the jobs test may have built it already (then it is in base)
    # Job B builds layer 2: keep 1 would remove layer 1, but job A uses it; the servers' environment stays.
    proc, _ = _train(lab, JOB_RECIPE, "--requirements", str(_job_requirements(lab, "second", "extrapkg>=1.0")),
                     name="job")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after_b = _layers(lab)
    layer_2 = after_b - base - layer_1
    assert len(layer_2) == 1 and servers <= after_b, (after_b, servers)
    in_use = {name for name in after_b if list((lab.workdir / ".envs" / name / ".in-use").glob(f"{job_a}.*"))}
    assert len(in_use) == 1 and in_use <= after_b, after_b  # layer 1, leased by job A, is still there
    # Job A ends; job C builds layer 3, and then layers 1 and 2 go (no job uses them), never the servers'.
    (lab.root / "out-a" / "go").write_text("")
    results = [lab.workdir / "skew" / lab.hosts[host][1] / "jobs" / job_a / "result.json" for host in ("h1", "h2")]
    deadline = time.monotonic() + 60
    while not all(path.exists() for path in results) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(path.exists() for path in results), results
    # Its result is written as its ranks leave; a rank still exiting runs layer 1's python, which
    # keeps the layer in use (as it should): the test waits for them to be gone, and for job B's,
    # which ran layer 2's (seen twice in full suites: the build after kept both layers).

    def users(layer: str) -> list[str]:
        path = str(lab.workdir / ".envs" / layer)
        return [cmdline(pid) for ns, _ in lab.hosts.values() for pid in lab.netns.pids(ns) if path in cmdline(pid)]
    while time.monotonic() < deadline + 30 and any(users(layer) for layer in in_use | layer_2):
        time.sleep(0.5)
    proc, _ = _train(lab, JOB_RECIPE, "--requirements", str(_job_requirements(lab, "third", "extrapkg>=1.1")),
                     name="job")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after_c = _layers(lab)
    kept = after_c & (in_use | layer_2)
    assert servers <= after_c and not kept, (after_c, servers, in_use, layer_2, {  # what held each
        layer: (users(layer), _leases(lab.workdir / ".envs" / layer)) for layer in kept})
    assert len(after_c - servers) == 1, after_c  # the newest (layer 3) and what the servers run
