"""Fixtures for cluster tests: real sshd on loopback, and hosts in network namespaces."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests._sshd import ClientKeys, NetnsLab, Sshd, cluster_yaml, require_root_tools


def distrun_processes(workdir: Path) -> list[psutil.Process]:
    """Live processes (servers, training) that belong to a server state folder under ``workdir``."""
    found = []
    prefix = str(workdir)
    for proc in psutil.process_iter():
        try:
            marker = proc.environ().get("DISTRUN_SERVER_DIR", "")
            if marker.startswith(prefix) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_all(workdir: Path) -> None:
    for proc in distrun_processes(workdir):
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


@dataclass
class Loopback:
    """One sshd on a loopback port, a client key it admits, a workdir, and cluster files for it."""

    root: Path
    keys: ClientKeys
    sshd: Sshd
    workdir: Path

    def trust_host_key(self) -> None:
        self.keys.known_hosts.write_text(self.sshd.known_hosts_line())

    def host(self, **overrides: object) -> dict:
        host = {"address": "127.0.0.1", "roles": "[chief, worker]", "ssh": f"{{port: {self.sshd.port}}}"}
        host.update({key: str(value) for key, value in overrides.items()})
        return host

    def write_cluster(self, *, hosts: list[dict] | None = None, extra: str = "", name: str = "cluster.yaml",
                      workdir: Path | None = None) -> Path:
        path = self.root / name
        path.write_text(cluster_yaml(self.keys, hosts or [self.host()], workdir=workdir or self.workdir, extra=extra))
        return path


@pytest.fixture
def loopback(tmp_path: Path) -> Iterator[Loopback]:
    require_root_tools()
    keys = ClientKeys(tmp_path / "client")
    sshd = Sshd(tmp_path / "sshd")
    sshd.start(keys.authorized_keys)
    bed = Loopback(tmp_path, keys, sshd, tmp_path / "work")
    bed.trust_host_key()
    try:
        yield bed
    finally:
        kill_all(tmp_path)
        sshd.stop()


@pytest.fixture
def make_sshd(tmp_path: Path) -> Iterator:
    """Extra sshds on loopback (their own config lines), stopped after the test."""
    started: list[Sshd] = []

    def make(authorized_keys: Path, extra_config: str = "", name: str = "sshd2") -> Sshd:
        sshd = Sshd(tmp_path / name, extra_config=extra_config)
        sshd.start(authorized_keys)
        started.append(sshd)
        return sshd

    yield make
    for sshd in started:
        sshd.stop()


_LAB_NUMBERS = itertools.count()


@dataclass
class Lab:
    """Two hosts (h1, h2) with sshd in their own namespaces, a client namespace, a bridge namespace."""

    netns: NetnsLab
    keys: ClientKeys
    client_ns: str
    hosts: dict[str, tuple[str, str]]  # name -> (namespace, address)
    workdir: Path
    root: Path

    @property
    def private(self) -> Path:
        """A folder each host sees as its own, empty at first (a tmpfs in its sshd's mount
        namespace), and the client as another, outside every host: no shared storage."""
        return self.root / "private"


@contextlib.contextmanager
def shaped_lab(tmp_path: Path, names: tuple[str, ...], rate_mbit: float | None = None) -> Iterator[Lab]:
    """Hosts ``names`` with sshd each; ``rate_mbit`` shapes every host's link (tc tbf)."""
    require_root_tools("ip", *(["tc"] if rate_mbit is not None else []))
    tag = f"dr{os.getpid() % 100000}{next(_LAB_NUMBERS)}"  # a module's lab may be up beside a test's own
    netns = NetnsLab(tag)
    sshds: list[Sshd] = []
    try:
        keys = ClientKeys(tmp_path / "client")
        client_ns, _ = netns.add_node("c", 10)
        hosts = {}
        lines = []
        for index, name in enumerate(names):
            ns, address = netns.add_node(name, 11 + index, rate_mbit=rate_mbit)
            sshd = Sshd(tmp_path / f"sshd-{name}", address=address, port=22, netns=ns, private=tmp_path / "private")
            sshd.start(keys.authorized_keys)
            sshds.append(sshd)
            hosts[name] = (ns, address)
            lines.append(sshd.known_hosts_line())
        keys.known_hosts.write_text("".join(lines))
        yield Lab(netns, keys, client_ns, hosts, tmp_path / "work", tmp_path)
    finally:
        kill_all(tmp_path)
        for sshd in sshds:
            sshd.stop()
        netns.close()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    """Two hosts, h1 and h2."""
    with shaped_lab(tmp_path, ("h1", "h2")) as made:
        yield made


@pytest.fixture
def lab3(tmp_path: Path) -> Iterator[Lab]:
    """Three hosts, h1, h2 and h3."""
    with shaped_lab(tmp_path, ("h1", "h2", "h3")) as made:
        yield made


# -- helpers for tests that drive the CLI from the lab's client namespace

def lab_cli(lab: Lab, *args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `distrun ARGS` in the client namespace, in the lab's folder (results come home there);
    ``env``: set on top of this process's environment."""
    return subprocess.run(["ip", "netns", "exec", lab.client_ns, sys.executable, "-m", "distrun", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=lab.root,
                          env={**os.environ, **env} if env else None)


def json_lines(proc: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def distrun_pids_in(lab: Lab, ns: str) -> list[int]:
    """Processes in a host namespace other than its sshd: what distrun runs or left there."""
    return [pid for pid in lab.netns.pids(ns) if "distrun" in cmdline(pid)]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def is_training_process(pid: int) -> bool:
    """A rank (or an --elastic agent): started cold (``-m distrun.runtime``), or forked by a worker
    server's warm interpreter, whose command line it keeps (a child of the zygote, itself not one)."""
    line = cmdline(pid)
    return "distrun.runtime" in line or ("distrun.launch._zygote" in line
                                          and "distrun.launch._zygote" in cmdline(_parent(pid)))


def training_pids(lab: Lab) -> list[int]:
    return [pid for ns, _ in lab.hosts.values() for pid in distrun_pids_in(lab, ns) if is_training_process(pid)]


@contextlib.contextmanager
def brought_up(lab: Lab, roles: dict[str, dict[str, str]], name: str, extra: str = "") -> Iterator[Path]:
    """A cluster file of the lab's hosts (name -> their keys, e.g. roles and slots), up, and after, down;
    ``extra``: more top-level lines of the file (``env: {...}``)."""
    hosts = [{"address": lab.hosts[host][1], **keys} for host, keys in roles.items()]
    path = lab.root / f"{name}.yaml"
    path.write_text(cluster_yaml(lab.keys, hosts, workdir=lab.workdir, name=name, extra=extra))
    up = lab_cli(lab, "up", str(path), "--json")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield path
    finally:
        lab_cli(lab, "down", str(path))


#: The `cluster` fixture's hosts: h1 chief and worker, h2 worker.
TWO_HOSTS = {"h1": {"roles": "[chief, worker]"}, "h2": {"roles": "[worker]"}}


@pytest.fixture
def cluster(lab: Lab) -> Iterator[Path]:
    """The lab's two hosts as a cluster file (h1 chief+worker, h2 worker), brought up and, after, down."""
    with brought_up(lab, TWO_HOSTS, "lab") as path:
        yield path


def module_lab_fixtures(name: str) -> tuple[Any, Any, Any]:
    """``lab`` and ``cluster`` fixtures of module scope (and the one they share), for a module whose
    tests leave hosts and servers as they found them: `distrun up` and `down` cost 3-5 s a test.
    A module binds them: ``_module_lab, lab, cluster = module_lab_fixtures("train-cluster")``."""

    @pytest.fixture(scope="module", name="_module_lab")
    def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, Path]]:
        with shaped_lab(tmp_path_factory.mktemp(name), ("h1", "h2")) as made:
            with brought_up(made, TWO_HOSTS, "lab") as path:
                yield made, path

    @pytest.fixture(scope="module", name="lab")
    def lab(_module_lab: tuple[Lab, Path]) -> Lab:
        return _module_lab[0]

    @pytest.fixture(scope="module", name="cluster")
    def cluster(_module_lab: tuple[Lab, Path]) -> Path:
        return _module_lab[1]

    return shared, lab, cluster


def bench_on_two_hosts(tmp_path: Path, workload: str, default_steps: str,
                       timeout: float = 1500) -> tuple[dict, str]:
    """``distrun bench WORKLOAD --cluster`` on two namespace hosts of one slot each, their links shaped
    to ``DISTRUN_BENCH_RATE_MBIT`` (unshaped without it), ``DISTRUN_BENCH_STEPS`` steps (else
    ``default_steps``): the report (printed, as the documented figures come from it) and the steps."""
    rate = os.environ.get("DISTRUN_BENCH_RATE_MBIT")
    steps = os.environ.get("DISTRUN_BENCH_STEPS", default_steps)
    with shaped_lab(tmp_path, ("h1", "h2"), rate_mbit=float(rate) if rate else None) as lab:
        roles = {"h1": {"roles": "[chief, worker]"}, "h2": {"roles": "[worker]"}}
        with brought_up(lab, roles, workload) as cluster:
            result = lab_cli(lab, "bench", workload, "--cluster", str(cluster), "--steps", steps, "--json",
                             timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    return report, steps
