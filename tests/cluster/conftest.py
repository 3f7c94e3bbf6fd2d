"""Fixtures for cluster tests: real sshd on loopback, and hosts in network namespaces."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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


@dataclass
class Lab:
    """Two hosts (h1, h2) with sshd in their own namespaces, a client namespace, a bridge namespace."""

    netns: NetnsLab
    keys: ClientKeys
    client_ns: str
    hosts: dict[str, tuple[str, str]]  # name -> (namespace, address)
    workdir: Path
    root: Path


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    require_root_tools("ip")
    tag = f"dr{os.getpid() % 100000}"
    netns = NetnsLab(tag)
    sshds: list[Sshd] = []
    try:
        keys = ClientKeys(tmp_path / "client")
        client_ns, _ = netns.add_node("c", 10)
        hosts = {}
        lines = []
        for index, name in enumerate(("h1", "h2")):
            ns, address = netns.add_node(name, 11 + index)
            sshd = Sshd(tmp_path / f"sshd-{name}", address=address, port=22, netns=ns)
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
