"""A real Slurm cluster in network namespaces: slurmctld, one slurmd per node, munge.

Debian's packages (slurmctld, slurmd, slurm-client, munge; 22.05 on bookworm).
Nothing is mocked: the tests drive sbatch, srun, squeue and scancel against
these daemons. What makes it work on one machine (found by trying):

- one munged, with its own key and a path socket, serves every node: a path
  socket is seen across network namespaces (``AuthInfo=socket=...``);
- slurmctld starts only if the hostname is its ``SlurmctldHost``, and slurmd
  takes its node name from ``-N``: each daemon gets a UTS namespace of its own;
- daemons enter the node's network namespace with ``nsenter --net`` in a private
  mount namespace: ``ip netns exec`` remounts /sys, which hides /sys/fs/cgroup,
  and slurmd 22.05 then dies ("Unable to initialize cgroup plugin");
- the lab's hosts file is bind-mounted over /etc/hosts in the daemons' mount
  namespaces, so tasks resolve node names; the real /etc/hosts is untouched;
- clients (srun, sbatch, squeue, scancel) find the lab through ``SLURM_CONF``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests._sshd import NetnsLab

#: The controller's last octet on the lab's /24; nodes are 11, 12, ...; the client 10.
CONTROLLER_OCTET = 2
SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "squeue", "scancel", "munged", "nsenter", "unshare")


def require_slurm() -> None:
    """Fail (never skip) with what is missing: CI installs all of it (.ci/run)."""
    import pytest

    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()]
    if missing:
        pytest.fail(f"the Slurm lab needs {', '.join(missing)}: apt-get install slurmctld slurmd slurm-client munge "
                    "util-linux (.ci/run does)")
    if os.geteuid() != 0:
        pytest.fail("the Slurm lab runs slurmd as root in network namespaces: run the tests as root")


def _sbin(tool: str) -> str:
    return shutil.which(tool) or f"/usr/sbin/{tool}"


class SlurmLab:
    """``nodes`` slurmds (n1, n2, ...) and a slurmctld, each in a namespace of ``netns``.

    ``env`` is what a client needs (``SLURM_CONF``); ``client(ns, argv)`` runs a
    Slurm command in namespace ``ns``. ``close()`` stops the daemons; the
    namespaces belong to ``netns``.
    """

    def __init__(self, root: Path, netns: NetnsLab, nodes: int, *, cpus_per_node: int = 2,
                 extra_hosts: dict[str, str] | None = None) -> None:
        self.root = root
        self.netns = netns
        self.root.mkdir(parents=True, exist_ok=True)
        self.daemons: list[subprocess.Popen] = []
        self.ctl_ns, self.ctl_address = netns.add_node("ctl", CONTROLLER_OCTET)
        self.nodes: dict[str, tuple[str, str]] = {}
        for index in range(nodes):
            name = f"n{index + 1}"
            self.nodes[name] = netns.add_node(name, 11 + index)
        self.hosts_file = root / "hosts"
        lines = ["127.0.0.1 localhost", f"{self.ctl_address} ctl"]
        lines += [f"{address} {name}" for name, (_ns, address) in self.nodes.items()]
        lines += [f"{address} {name}" for name, address in (extra_hosts or {}).items()]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        self.socket = root / "munge" / "munge.socket"
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        try:
            self._start_munge()
            self._write_conf(cpus_per_node)
            self._start(self.ctl_ns, "ctl", [_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            for name, (ns, _address) in self.nodes.items():
                self._start(ns, name, [_sbin("slurmd"), "-D", "-N", name, "-f", str(self.conf)])
            self._wait_idle()
        except BaseException:
            self.close()
            raise

    # -- daemons

    def _start_munge(self) -> None:
        folder = self.socket.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        proc = subprocess.Popen(
            [_sbin("munged"), "-F", "--force", f"--socket={self.socket}", f"--key-file={key}",
             f"--log-file={folder / 'munged.log'}", f"--pid-file={folder / 'munged.pid'}",
             f"--seed-file={folder / 'munged.seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self.daemons.append(proc)
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {proc.stderr.read().decode() if proc.stderr else ''}")
            time.sleep(0.05)

    def _write_conf(self, cpus_per_node: int) -> None:
        spool = self.root / "spool"
        (spool / "ctl").mkdir(parents=True, exist_ok=True)
        for name in self.nodes:
            (spool / name).mkdir(parents=True, exist_ok=True)
        node_lines = [f"NodeName={name} NodeAddr={address} CPUs={cpus_per_node} State=UNKNOWN"
                      for name, (_ns, address) in self.nodes.items()]
        self.conf.write_text("\n".join([
            "ClusterName=lab",
            f"SlurmctldHost=ctl({self.ctl_address})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket},cred_expire=10",  # also how long a requeued job waits
            f"StateSaveLocation={spool / 'ctl'}",
            f"SlurmdSpoolDir={spool}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1",
            "MinJobAge=2",
            "KillWait=2",
            "InactiveLimit=0",
            "SlurmctldTimeout=10",
            "SlurmdTimeout=10",
            *node_lines,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _start(self, ns: str, hostname: str, argv: list[str]) -> None:
        """``argv`` in namespace ``ns`` with its own hostname and the lab's /etc/hosts."""
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        log = open(self.root / f"{hostname}.out", "ab")  # noqa: SIM115 - the daemon holds it
        proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", script, "sh", hostname, str(self.hosts_file), *argv],
            env=self.env, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.daemons.append(proc)

    def _wait_idle(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({proc.args[-1]}): see {self.root}/*.log")
            out = self.client(self.ctl_ns, ["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
            last = out.stdout + out.stderr
            states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
            if states and all(states.get(name) == "idle" for name in self.nodes):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the Slurm lab's nodes did not become idle within {timeout_s:g} s: {last.strip()}")

    # -- clients

    def client(self, ns: str, argv: list[str], *, check: bool = True, timeout: float = 60,
               input: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """A Slurm command (or anything) in network namespace ``ns`` with the lab's SLURM_CONF,
        run in ``cwd`` (default: the lab's folder; sbatch writes output where it is run)."""
        proc = subprocess.run(["ip", "netns", "exec", ns, *argv], env=self.env, capture_output=True, text=True,
                              timeout=timeout, input=input, cwd=cwd or self.root)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
        return proc

    def jobs(self) -> list[str]:
        """Every job slurmctld still lists, as ``id state`` lines."""
        out = self.client(self.ctl_ns, ["squeue", "-h", "-o", "%i %T"], check=False)
        return [line for line in out.stdout.splitlines() if line.strip()]

    def close(self) -> None:
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in reversed(self.daemons):
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
