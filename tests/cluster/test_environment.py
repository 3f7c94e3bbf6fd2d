"""Each host's Python environment from the cluster file (issue 49): ``requirements:`` and ``wheels:``.

Two namespace hosts with real sshd and no route to any package index: the only packages
are a wheel this module builds with ``pip wheel`` (``clickutil``, ``VALUE = 41``; 2.0 has
42) and the client's own distrun. The hosts share this machine's filesystem, as hosts
sharing a home folder over NFS do, so they share an environment too (built once, under a
lock). The lab's python has uv beside it (the ``test`` extra installs it), so ``installer:
auto`` builds with uv; ``installer: pip`` keeps pip's path tested. The tests run in order on
one lab: build (uv), reuse, rebuild from a pyproject.toml (pip), a changed ``python:``, a
failed install (uv, then pip); then distrun from the client, and (no lab) bad paths, the
keys' parsing and a port that never sends an SSH banner.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import socket
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._sshd import cluster_yaml
from tests.cluster.conftest import Lab, cmdline, json_lines, lab_cli, shaped_lab
from tests.conftest import run_cli

RECIPE = """
import os
import clickutil   # only in the cluster's environment: not on the client

OUT = os.environ["CLICKUTIL_OUT"]

def main(strategy):
    total = strategy.reduce("sum", float(clickutil.VALUE))
    with open(os.path.join(OUT, f"rank{strategy.replica_id}.txt"), "w") as out:
        out.write(f"{clickutil.VALUE} {total} {clickutil.__file__}")
"""

_PYPROJECT = """[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"
[project]
name = "{name}"
version = "{version}"
[tool.setuptools]
packages = ["{name}"]
"""


def _wheel(root: Path, name: str, version: str, body: str, into: Path) -> None:
    """A wheel of a throwaway package, built by pip as a user would (no index, no isolation)."""
    src = root / f"{name}-{version}"
    (src / name).mkdir(parents=True)
    (src / "pyproject.toml").write_text(_PYPROJECT.format(name=name, version=version))
    (src / name / "__init__.py").write_text(body)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(into), str(src)], check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with shaped_lab(tmp_path_factory.mktemp("environment"), ("h1", "h2")) as made:
        wheels = made.root / "wheels"
        _wheel(made.root / "src", "clickutil", "1.0", "VALUE = 41\n", wheels)
        _wheel(made.root / "src", "clickutil", "2.0", "VALUE = 42\n", wheels)
        try:
            yield made
        finally:
            for name in ("env", "own"):
                if (made.root / f"{name}.yaml").exists():
                    lab_cli(made, "down", str(made.root / f"{name}.yaml"))


def _cluster(lab: Lab, name: str, extra: str, python: str | None = None) -> Path:
    hosts = [{"address": lab.hosts["h1"][1], "roles": "[chief, worker]"}, {"address": lab.hosts["h2"][1]}]
    text = cluster_yaml(lab.keys, hosts, workdir=lab.workdir, name=name, extra=extra)
    if python is not None:
        text = text.replace(f"python: {sys.executable}", f"python: {python}")
    path = lab.root / f"{name}.yaml"
    path.write_text(text)
    return path


#: The rows of the last `up` of each cluster file: the next test starts from them (no `up` only to look).
_LAST: dict[Path, dict] = {}


def _up(lab: Lab, cluster: Path) -> tuple[subprocess.CompletedProcess, dict, float]:
    t0 = time.monotonic()
    proc = lab_cli(lab, "up", str(cluster), "--json", timeout=300)
    wall_s = time.monotonic() - t0
    reports = [line for line in json_lines(proc) if line.get("type") == "cluster"]
    assert reports, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {row["host"]: row for row in reports[-1]["hosts"]}
    if proc.returncode == 0:
        _LAST[cluster] = rows
    return proc, rows, wall_s


def _last_up(lab: Lab, cluster: Path) -> dict:
    """The rows of the previous test's `up` of ``cluster`` (one now, when this test runs alone)."""
    return _LAST[cluster] if cluster in _LAST else _up(lab, cluster)[1]


def _marker(lab: Lab, name: str) -> dict:
    return json.loads((lab.workdir / ".envs" / name / ".distrun-ready").read_text())


def _python_of(row: dict) -> str:
    """The interpreter a host's server runs (its argv[0]: the hosts are namespaces of this machine)."""
    return cmdline(row["server"]["pid"]).split()[0]


def _env_name(row: dict) -> str:
    """The environment a host's server runs in: .../.envs/<name>/bin/python."""
    parts = Path(_python_of(row)).parts
    assert ".envs" in parts, _python_of(row)
    return parts[parts.index(".envs") + 1]


def _value_in(python: str, module: str = "clickutil") -> str:
    done = subprocess.run([python, "-c", f"import {module}; print({module}.__version__ if '{module}' == 'distrun' "
                                         f"else {module}.VALUE, {module}.__file__)"],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def _env_keys(out: Path) -> str:
    return f"requirements: [clickutil==1.0]\nwheels: wheels\nenv: {{CLICKUTIL_OUT: '{out}'}}"


def test_a_package_only_in_wheels_trains_on_two_hosts(lab: Lab) -> None:
    assert importlib.util.find_spec("clickutil") is None  # the client has no clickutil: only the hosts' environment
    assert importlib.util.find_spec("uv") is not None, "uv is in the test extra: pip install -e '.[test]'"
    out = lab.root / "out"
    out.mkdir()
    cluster = _cluster(lab, "env", _env_keys(out))
    up, rows, wall_s = _up(lab, cluster)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert [row["status"] for row in rows.values()] == ["started", "started"]
    names = {_env_name(row) for row in rows.values()}
    assert len(names) == 1  # one interpreter, one spec, one shared filesystem: one environment, built once
    name = names.pop()
    notes = sorted(row["message"] for row in rows.values())
    uv = _marker(lab, name)["installer"]  # the lab's python has uv beside it: installer auto takes it
    assert uv.startswith("uv ") and notes == [f"environment {name} built with {uv}", f"environment {name} reused"], notes
    env_dir = lab.workdir / ".envs" / name
    assert "+ clickutil==1.0" in (env_dir / "install.log").read_text()
    # uv saw the base's packages (torch...) through their metadata, and left none of those copies behind.
    site = next(env_dir.glob("lib/python*/site-packages"))
    assert sorted(path.name for path in site.glob("*.dist-info")) == ["clickutil-1.0.dist-info"]
    print(f"first up, environment built: {wall_s:.1f} s")

    recipe = lab.root / "code" / "uses_clickutil.py"
    recipe.parent.mkdir()
    recipe.write_text(RECIPE)
    train = lab_cli(lab, "train", str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json",
                    timeout=300)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    job = json_lines(train)[0]
    assert job["world_size"] == 2 and len(job["hosts"]) == 2
    for rank in (0, 1):
        value, total, where = (out / f"rank{rank}.txt").read_text().split()
        assert (value, total) == ("41", "82.0") and where.startswith(str(env_dir))


def test_a_second_up_reuses_the_environment(lab: Lab) -> None:
    cluster = lab.root / "env.yaml"
    name = _env_name(next(iter(_last_up(lab, cluster).values())))
    env_dir = lab.workdir / ".envs" / name
    marker, log = (env_dir / ".distrun-ready").stat(), (env_dir / "install.log").stat()
    before = sorted(path.name for path in (lab.workdir / ".envs").iterdir())
    up, rows, wall_s = _up(lab, cluster)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert [(row["status"], row["message"]) for row in rows.values()] == [("up", f"environment {name} reused")] * 2
    # Each server says the environment it runs in (the dashboard's hosts page shows it).
    assert [row["server"]["environment"] for row in rows.values()] == [name] * 2, rows
    # Nothing was installed: the marker and pip's log are the first build's, no folder is new.
    assert (env_dir / ".distrun-ready").stat().st_mtime_ns == marker.st_mtime_ns
    assert (env_dir / "install.log").stat().st_mtime_ns == log.st_mtime_ns
    assert sorted(path.name for path in (lab.workdir / ".envs").iterdir()) == before
    print(f"second up, nothing changed: {wall_s:.1f} s")


def _old_wheels_folder(lab: Lab, name: str, age_s: float) -> Path:
    folder = lab.workdir / ".envs" / f"wheels-{name}"
    folder.mkdir()
    (folder / "clickutil-0.1-py3-none-any.whl").write_bytes(b"not read")
    (folder / ".complete").touch()
    for path in (folder / ".complete", folder):
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return folder


def test_a_changed_requirement_rebuilds_the_environment(lab: Lab) -> None:
    """The requirement now from a pyproject.toml's dependencies, installed by pip (``installer: pip``).
    The build then removes wheels folders that no environment was built from, but not one a build
    holds (its lock) or one sent within the hour (a build from it may be on its way)."""
    cluster = lab.root / "env.yaml"
    old = {host: _env_name(row) for host, row in _last_up(lab, cluster).items()}
    wheels = {p for p in (lab.workdir / ".envs").glob("wheels-*") if p.is_dir()}
    assert wheels and all(path.name.endswith(".lock") is False for path in wheels)
    stale = _old_wheels_folder(lab, "0000000000000001", age_s=7200)
    held = _old_wheels_folder(lab, "0000000000000002", age_s=7200)
    fresh = _old_wheels_folder(lab, "0000000000000003", age_s=60)
    (lab.root / "pyproject.toml").write_text('[project]\nname = "trainer"\nversion = "0.1"\n'
                                             'dependencies = ["clickutil==2.0"]\n')
    cluster.write_text(cluster.read_text().replace("requirements: [clickutil==1.0]",
                                                   "requirements: pyproject.toml\ninstaller: pip"))
    with open(f"{held}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # as a build from it does
        up, rows, _ = _up(lab, cluster)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert not stale.exists() and held.exists() and fresh.exists()
    assert all(path.exists() for path in wheels)  # the environments were built from them
    assert [row["status"] for row in rows.values()] == ["restarted", "restarted"]  # the old servers were stale
    for host, row in rows.items():
        assert _env_name(row) != old[host]
        assert _value_in(_python_of(row)).startswith("42 ")
    name = _env_name(next(iter(rows.values())))
    assert f"environment {name} built with pip" in {row["message"] for row in rows.values()}
    assert _marker(lab, name)["installer"] == "pip" and _marker(lab, name)["requirements"] == ["clickutil==2.0"]
    assert (lab.workdir / ".envs" / next(iter(old.values())) / ".distrun-ready").exists()  # the old one is kept


def test_a_changed_python_makes_the_running_server_stale(lab: Lab) -> None:
    """Issue 49, item 5: `python:` changed, and `up` used to keep the server on the old interpreter.
    The same interpreter under another path is another `python:`, so another environment too."""
    cluster = lab.root / "env.yaml"
    old = {host: _env_name(row) for host, row in _last_up(lab, cluster).items()}
    other = lab.root / "bin" / "python3"
    other.parent.mkdir(exist_ok=True)
    other.symlink_to(sys.executable)
    cluster.write_text(cluster.read_text().replace(f"python: {sys.executable}", f"python: {other}")
                       .replace("\ninstaller: pip", ""))
    up, rows, _ = _up(lab, cluster)
    assert up.returncode == 0 and {row["status"] for row in rows.values()} == {"restarted"}, up.stdout[-3000:]
    for host, row in rows.items():
        assert _env_name(row) != old[host]
        assert _value_in(_python_of(row)).startswith("42 ")


def test_an_unresolvable_requirement_is_exit_6_naming_the_host(lab: Lab) -> None:
    cluster = lab.root / "env.yaml"
    before = {host: row["server"]["pid"] for host, row in _last_up(lab, cluster).items()}
    cluster.write_text(cluster.read_text().replace("requirements: pyproject.toml",
                                                   "requirements: [clickutil==2.0, nosuchpkg==3.1]"))
    envs = sorted(path.name for path in (lab.workdir / ".envs").iterdir() if not path.name.endswith(".lock"))
    up, rows, _ = _up(lab, cluster)  # installer auto: uv
    assert up.returncode == 6, up.stdout[-3000:] + up.stderr[-3000:]
    failed = [row for row in rows.values() if row["status"] == "error"]
    assert failed, rows
    for row in failed:
        assert row["message"].startswith("installing nosuchpkg==3.1 failed: uv: No solution found when resolving "
                                         "dependencies: Because nosuchpkg was not found"), row["message"]
        assert "\n" not in row["message"]
    # The cluster is left as it was: every server still the one from before, no environment half-built.
    status = lab_cli(lab, "status", str(cluster), "--json")
    assert status.returncode == 0, status.stdout[-3000:] + status.stderr[-3000:]
    assert {row["host"]: row["server"]["pid"] for row in json.loads(status.stdout)["hosts"]} == before
    assert sorted(path.name for path in (lab.workdir / ".envs").iterdir() if not path.name.endswith(".lock")) == envs
    cluster.write_text(cluster.read_text() + "\ninstaller: pip\n")
    plain = lab_cli(lab, "up", str(cluster))  # pip's verdict; the table's notes: one line per failed host, naming it
    assert plain.returncode == 6
    lines = [line for line in plain.stdout.splitlines() if "nosuchpkg==3.1" in line]
    assert lines and all(any(line.strip().startswith(f"{host}:") for host in rows) for line in lines), plain.stdout
    assert "ERROR: No matching distribution found for nosuchpkg==3.1" in plain.stdout, plain.stdout


def test_distrun_itself_comes_from_the_client(lab: Lab) -> None:
    """A host python with another distrun (0.0.9, a stub) and no setup: `up` brings the client's."""
    stub_wheels = lab.root / "stub-wheels"
    _wheel(lab.root / "src", "distrun", "0.0.9", '__version__ = "0.0.9"\n', stub_wheels)
    venv = lab.root / "old-python"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    *map(str, stub_wheels.glob("*.whl"))], check=True, capture_output=True, timeout=120)
    assert _value_in(str(venv / "bin" / "python"), "distrun").startswith("0.0.9 ")
    cluster = _cluster(lab, "own", "", python=str(venv / "bin" / "python"))
    up, rows, _ = _up(lab, cluster)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    for row in rows.values():
        assert row["status"] == "started" and row["message"].endswith("(distrun from the client)"), row
        version, where = _value_in(_python_of(row), "distrun").split()
        assert version == "0.1.0" and where.startswith(str(lab.workdir / ".envs" / _env_name(row)))
    # `down` sweeps with the environment's python: the host's own cannot run distrun.server.
    down = lab_cli(lab, "down", str(cluster), "--json")
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    cluster.unlink()


@pytest.mark.parametrize("extra, named", [
    ("wheels: no-such-folder", "no-such-folder"),
    ("requirements: missing-requirements.txt", "missing-requirements.txt"),
])
def test_a_bad_path_is_exit_2_naming_it(tmp_path: Path, extra: str, named: str) -> None:
    cluster = tmp_path / "bad.yaml"
    cluster.write_text(f"name: bad\n{extra}\nhosts: [10.199.0.250]\n")
    result = run_cli("up", str(cluster))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(tmp_path / named) in lines[0] and lines[0].startswith(f"error: {cluster}:2: "), lines


def test_a_port_that_never_sends_a_banner_is_one_line(tmp_path: Path) -> None:
    """Issue 49, item 5: TCP accepted, no SSH banner ever. Not "sshd keeps refusing", no paramiko traceback."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections wait in the backlog: accepted by the kernel, never answered
    port = silent.getsockname()[1]
    cluster = tmp_path / "silent.yaml"
    cluster.write_text(f"name: silent\nssh: {{connect_timeout_s: 2, known_hosts: {tmp_path / 'known_hosts'}}}\n"
                       f"hosts: [{{address: 127.0.0.1, ssh: {{port: {port}}}}}]\n")
    try:
        result = run_cli("up", str(cluster))
    finally:
        silent.close()
    output = result.stdout + result.stderr
    assert result.returncode == 6, output
    assert f"127.0.0.1:{port}: no SSH server answered within 2 s" in output, output
    assert "Traceback" not in output and "paramiko" not in output.lower() and "refusing" not in output, output
    assert result.wall_s < 2 + 8, f"up took {result.wall_s:.1f} s"


def test_the_environment_keys_parse_and_refuse_bad_values(tmp_path: Path) -> None:
    from distrun.config import parse_cluster
    from distrun.errors import ConfigError

    (tmp_path / "wheels").mkdir()
    (tmp_path / "reqs.txt").write_text("# comment\nclickutil==1.0\n\n-f extra\n")
    spec = parse_cluster("requirements: reqs.txt\nwheels: wheels\nhosts: [h1]\n", "c.yaml", tmp_path).environment
    assert spec is not None and spec.requirements == ("clickutil==1.0", "-f extra") and spec.index is False
    assert spec.wheels == str(tmp_path / "wheels") and spec.source == str(tmp_path / "reqs.txt")
    online = parse_cluster("requirements: [a==1]\nindex: https://pypi.example/simple\nhosts: [h1]\n", "c.yaml", tmp_path)
    assert online.environment is not None and online.environment.index == "https://pypi.example/simple"
    assert parse_cluster("hosts: [h1]\n", "c.yaml", tmp_path).environment is None
    kept = parse_cluster("keep_environments: 2\nhosts: [h1]\n", "c.yaml", tmp_path).environment
    assert kept is not None and kept.keep == 2 and kept.empty and kept.index is False  # no packages: no index asked
    assert spec.keep == 5
    for text, said in [('requirements: ["a\\nb"]', "c.yaml:1: requirements[0]: must be one requirement on one line"),
                       ("index: ftp://x", "c.yaml:1: index: must be true, false or an http(s) index URL"),
                       ("wheels: reqs.txt", f"c.yaml:1: wheels: {tmp_path / 'reqs.txt'} is not a folder"),
                       ("requirements: wheels", f"c.yaml:1: requirements: cannot read {tmp_path / 'wheels'}: Is a directory"),
                       ("keep_environments: 0", "c.yaml:1: keep_environments: must be a whole number from 1 to 1000"),
                       ("requirement: [a]", "c.yaml:1: requirement: unknown key (did you mean 'requirements'?)")]:
        with pytest.raises(ConfigError) as caught:
            parse_cluster(f"{text}\nhosts: [h1]\n", "c.yaml", tmp_path)
        assert str(caught.value).startswith(said), str(caught.value)
