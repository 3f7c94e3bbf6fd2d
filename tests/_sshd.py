"""Real OpenSSH servers for tests: throwaway keys, loopback ports or network namespaces.

Nothing here is a mock: ``Sshd`` runs Debian's ``/usr/sbin/sshd`` in the
foreground with a config of its own (keys, authorized_keys, pid file in a
temporary folder), and ``NetnsLab`` builds hosts in Linux network namespaces
joined by a bridge that itself lives in a namespace, so no address or route is
ever added to the machine's own namespace. Missing prerequisites fail the test
with the reason; nothing skips.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"


def require_root_tools(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.fail("these tests need root (sshd for root logins, network namespaces)")
    if not os.path.exists(SSHD):
        pytest.fail(f"{SSHD} is missing: apt-get install -y openssh-server (.ci/run does this)")
    for tool in ("ssh-keygen", *tools):
        if shutil.which(tool) is None:
            pytest.fail(f"`{tool}` is missing: apt-get install -y openssh-server iproute2 (.ci/run does this)")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation folder


def keygen(path: Path) -> str:
    """Make an ed25519 key pair at ``path``; return the public key line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "distrun-test", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip() if path.suffix else Path(f"{path}.pub").read_text().strip()


def fingerprint(pub_path: Path) -> str:
    """OpenSSH's own SHA256 fingerprint of a public key (to compare with distrun's message)."""
    out = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(pub_path)], check=True,
                         capture_output=True, text=True).stdout
    return out.split()[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Sshd:
    """One sshd; ``known_hosts_line`` is its host key as known_hosts wants it."""

    root: Path
    address: str = "127.0.0.1"
    port: int = 0
    netns: str | None = None
    extra_config: str = ""
    sftp: bool = True  # False: no Subsystem line, as some hardened hosts have
    #: A folder this host alone sees (its sshd's mount namespace has a tmpfs there, and so every
    #: session and server it starts): a host's own disk, with no shared storage. Needs ``netns``.
    private: Path | None = None
    process: subprocess.Popen | None = None
    host_key: Path = field(init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.host_key = self.root / "host_ed25519"
        keygen(self.host_key)

    @property
    def host_pub(self) -> Path:
        return Path(f"{self.host_key}.pub")

    def known_hosts_line(self) -> str:
        name = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        key_type, key = self.host_pub.read_text().split()[:2]
        return f"{name} {key_type} {key}\n"

    def start(self, authorized_keys: Path) -> None:
        if not self.port:
            self.port = free_port()
        config = self.root / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress {self.address}\nHostKey {self.host_key}\n"
            f"PidFile {self.root}/sshd.pid\nAuthorizedKeysFile {authorized_keys}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nStrictModes no\nAllowTcpForwarding yes\n"
            + ("Subsystem sftp internal-sftp\n" if self.sftp else "") + "LogLevel VERBOSE\n" + self.extra_config
        )
        argv = [SSHD, "-D", "-e", "-f", str(config)]
        if self.private is not None:  # `ip netns exec` unshares the mount namespace: the tmpfs stays in it
            self.private.mkdir(parents=True, exist_ok=True)
            argv = ["sh", "-c", 'mount -t tmpfs -o size=512m,mode=1777 distrun-private "$0" && exec "$@"',
                    str(self.private), *argv]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        log = open(self.root / "sshd.log", "ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"sshd exited with {self.process.returncode}: {(self.root / 'sshd.log').read_text()[-2000:]}")
            if self._answers():
                return
            time.sleep(0.05)
        pytest.fail(f"sshd did not answer on {self.address}:{self.port}: {(self.root / 'sshd.log').read_text()[-2000:]}")

    def _answers(self) -> bool:
        probe = [sys.executable, "-c",
                 "import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 1); "
                 "sys.exit(0 if s.recv(4) == b'SSH-' else 1)", self.address, str(self.port)]
        if self.netns:
            probe = ["ip", "netns", "exec", self.netns, *probe]
        return subprocess.run(probe, capture_output=True).returncode == 0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)


@dataclass
class ClientKeys:
    """A client key pair and the authorized_keys file that admits it."""

    root: Path

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.identity = self.root / "id_ed25519"
        public = keygen(self.identity)
        self.authorized_keys = self.root / "authorized_keys"
        self.authorized_keys.write_text(public + "\n")
        self.known_hosts = self.root / "known_hosts"
        self.known_hosts.write_text("")


def cluster_yaml(keys: ClientKeys, hosts: list[dict], *, workdir: Path, name: str = "test", extra: str = "") -> str:
    """A cluster file for the test sshds: root logins with the throwaway key."""
    lines = [
        f"name: {name}",
        "ssh:",
        "  user: root",
        f"  identity_file: {keys.identity}",
        f"  known_hosts: {keys.known_hosts}",
        "  connect_timeout_s: 5",
        f"python: {sys.executable}",
        f"workdir: '{workdir}'",
    ]
    if extra:
        lines.append(extra.rstrip())
    lines.append("hosts:")
    for host in hosts:
        parts = ", ".join(f"{key}: {value}" for key, value in host.items())
        lines.append(f"  - {{{parts}}}")
    return "\n".join(lines) + "\n"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class NetnsLab:
    """Hosts in network namespaces on one bridge (itself in a namespace), plus a client namespace.

    Addresses come from 10.199.0.0/24, which exists only inside these
    namespaces. Everything is deleted in ``close()``, processes first.
    """

    SUBNET = "10.199.0"

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.bridge_ns = f"{tag}br"
        self.namespaces: list[str] = []
        ip("netns", "add", self.bridge_ns)
        self.namespaces.append(self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge_ns, "link", "set", "br0", "up")

    def add_node(self, name: str, octet: int, rate_mbit: float | None = None) -> tuple[str, str]:
        """A namespace joined to the bridge; returns (namespace, address).

        ``rate_mbit``: shape the node's link to that rate in both directions (``tc`` tbf
        on each end of its veth), as a host with that NIC would be.
        """
        ns = f"{self.tag}{name}"
        ip("netns", "add", ns)
        self.namespaces.append(ns)
        port = f"v{self.tag[-6:]}{name}"[:15]
        ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
        address = f"{self.SUBNET}.{octet}"
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        if rate_mbit is not None:
            self.shape(name, rate_mbit)
        return ns, address

    def shape(self, name: str, rate_mbit: float | None) -> None:
        """Shape node ``name``'s link to ``rate_mbit`` in both directions (``tc`` tbf on each end of its
        veth), or, with None, take the shaping off."""
        ns, port = f"{self.tag}{name}", f"v{self.tag[-6:]}{name}"[:15]
        for where, dev in ((ns, "eth0"), (self.bridge_ns, port)):
            if rate_mbit is None:
                subprocess.run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False)
                continue
            # burst: a few ms at the rate; latency bounds the queue (rate x 100 ms).
            burst_kb = max(32, int(rate_mbit * 1000 / 8 * 0.004))
            subprocess.run(["tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                            f"{rate_mbit:g}mbit", "burst", f"{burst_kb}kb", "latency", "100ms"],
                           capture_output=True, text=True, check=True)

    def pids(self, ns: str) -> list[int]:
        out = ip("netns", "pids", ns, check=False).stdout
        return [int(pid) for pid in out.split()]

    def close(self) -> None:
        for ns in self.namespaces:
            for pid in self.pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in reversed(self.namespaces):
            ip("netns", "del", ns, check=False)
