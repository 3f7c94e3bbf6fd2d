"""``distrun doctor [CLUSTER]``: one row per host of what makes or breaks a job there.

Every host is asked at once, each with its own bounds, so an unreachable host is a row
that says why ("down"), never a hang. Asked of each host's worker server:

- SSH and the server itself (a host without one is "down": run ``distrun up``);
- python, distrun (it must be the client's version), and what torch sees: its version,
  CUDA, NCCL, GPUs (a short-lived ``python -c`` of the server's interpreter);
- the environment the server runs in (its content hash, when `up` built one), and its
  Python and torch beside the client's: a job is refused where they differ (``client/_skew``);
- the installer: the one that built that environment ("uv 0.9.2" or "pip"), else what
  ``installer:`` resolves to on that host (uv where it has one, else pip);
- free disk in the host's distrun folder, and the host's clock against this machine's
  (the midpoint of a quick round trip);
- the interface its route to the chief leaves by, and whether it can open a TCP
  connection to a port the chief listens on for the purpose, as ranks will to the
  rendezvous port (``network.port_range`` is honoured).

Problems (exit 6): down, a distrun version that differs, torch that does not import, a
Python minor version or torch release other than the client's (a job would be refused
without ``--allow-skew``), the chief's port not reached. Warnings (exit 0): clock skew over 1 s, under 1 GiB free, fewer
GPUs than the cluster file's ``gpus:``, torch built without CUDA on a host with GPUs, ``installer: uv``
on a host without uv.
"""

from __future__ import annotations

import ipaddress
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from distrun._version import __version__
from distrun.client._links import HostLink
from distrun.client._skew import HostFacts, client_facts
from distrun.config import ClusterSpec, HostSpec
from distrun.errors import HostError

__all__ = ["DoctorRow", "run_doctor", "doctor_exit_code", "SKEW_WARN_S", "FREE_WARN_BYTES"]

SKEW_WARN_S = 1.0
FREE_WARN_BYTES = 1 << 30


@dataclass(frozen=True)
class DoctorRow:
    host: str
    status: str  # ok | warn | problem | down
    python: str | None = None
    distrun: str | None = None
    torch: str | None = None
    cuda: str | None = None
    nccl: str | None = None
    gpus: int | None = None
    free_bytes: int | None = None
    skew_s: float | None = None
    interface: str | None = None
    reaches_chief: bool | None = None
    environment: str | None = None  # the environment's name (a content hash) when `up` built one
    installer: str | None = None  # what built it, else what `installer:` resolves to there: "uv 0.9.2" | "pip"
    client_python: str | None = None  # the client's, side by side with the host's
    client_torch: str | None = None
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"type": "doctor", **asdict(self), "problems": list(self.problems), "warnings": list(self.warnings)}


@dataclass
class _Probe:
    chief_address: str
    port: int | None
    chief_problem: str | None = None
    rows: list[DoctorRow] = field(default_factory=list)


def run_doctor(cluster: ClusterSpec) -> list[DoctorRow]:
    """One row per host, in the cluster file's order."""
    chief = cluster.chief
    chief_address = "127.0.0.1" if cluster.local else chief.address
    probe = _Probe(chief_address, None)
    link = HostLink(cluster, chief)
    try:
        link.open()
        port_range = list(cluster.network.port_range) if cluster.network.port_range else None
        probe.port = int(link.call("doctor_listen", port_range=port_range, address=chief_address,
                                   interface=cluster.network.interface)["port"])
    except HostError as exc:
        probe.chief_problem = exc.reason
    finally:
        link.close()
    client = client_facts(())
    with ThreadPoolExecutor(max_workers=min(32, len(cluster.hosts))) as pool:
        return list(pool.map(lambda host: _row(cluster, host, probe, client), cluster.hosts))


def _row(cluster: ClusterSpec, host: HostSpec, probe: _Probe, client: HostFacts) -> DoctorRow:
    link = HostLink(cluster, host)
    try:
        link.open()
        assert link.info is not None
        t0 = time.time()
        their_time = float(link.call("doctor", clock_only=True)["time"])
        t1 = time.time()
        facts = link.call("doctor", chief=probe.chief_address, port=probe.port, installer=_installer(cluster))
    except HostError as exc:
        return DoctorRow(host=host.label, status="down", problems=(exc.reason,))
    finally:
        link.close()
    problems, warnings = [], []
    if link.info.version != __version__:
        problems.append(f"distrun {link.info.version} there, {__version__} here: `distrun up` installs this one")
    if facts.get("torch_error"):
        problems.append(f"torch: {facts['torch_error']}")
    problems += _skew(link.info.python, facts.get("torch"), client)
    if facts.get("torch") and not facts.get("cuda") and link.info.gpu_count:
        warnings.append(f"torch {facts['torch']} was built without CUDA, and the host has {link.info.gpu_count} "
                        "GPU(s): a job on them is refused (install a CUDA build of torch there)")
    reach = facts.get("reaches_chief")
    if probe.port is None:
        problems.append(f"the chief's port could not be opened: {probe.chief_problem}")
    elif reach is not None:
        problems.append(f"cannot reach the chief {probe.chief_address}:{probe.port} ({reach}): check firewalls, "
                        "network.port_range and network.interface")
    skew = their_time - (t0 + t1) / 2
    if abs(skew) > SKEW_WARN_S:
        warnings.append(f"clock {skew:+.1f} s from this machine's (timestamps in logs will disagree)")
    free = int(facts["free_bytes"])
    if free < FREE_WARN_BYTES:
        warnings.append(f"only {free / 2**30:.2f} GiB free in {link.state_dir}")
    public = _public(facts.get("data_address"))
    if public:
        warnings.append(f"the data plane would use {public}, a public address: gloo and NCCL traffic is neither "
                        "authenticated nor encrypted (docs/security.md); set network.interface to a private network")
    if facts.get("installer") is None and _installer(cluster) == "uv":
        warnings.append("installer: uv, and there is no uv on PATH or beside the host's python: "
                        "`up` cannot build an environment there (install uv, or installer: auto)")
    gpus = facts.get("gpus")
    if host.gpus and (gpus or 0) < host.gpus:
        warnings.append(f"the cluster file says gpus: {host.gpus}; torch sees {gpus or 0}")
    return DoctorRow(
        host=host.label, status="problem" if problems else "warn" if warnings else "ok",
        python=link.info.python, distrun=link.info.version, torch=facts.get("torch"), cuda=facts.get("cuda"),
        nccl=facts.get("nccl"), gpus=gpus, free_bytes=free, skew_s=skew, interface=facts.get("interface"),
        reaches_chief=None if probe.port is None else reach is None, environment=facts.get("environment"),
        installer=facts.get("installer"),
        client_python=client.python_full, client_torch=client.version("torch"),
        problems=tuple(problems), warnings=tuple(warnings))


def _installer(cluster: ClusterSpec) -> str:
    return cluster.environment.installer if cluster.environment is not None else "auto"


def _skew(python: str | None, torch: str | None, client: HostFacts) -> list[str]:
    """What a job's skew checks would refuse on this host (``--allow-skew`` lets it run)."""
    found = []
    if python and python.split(".")[:2] != client.python.split("."):
        found.append(f"Python {python} where the client has {client.python_full}: a job is refused (set python: to "
                     f"a Python {client.python} there, or --allow-skew)")
    ours = (client.version("torch") or "").split("+")[0]
    theirs = (torch or "").split("+")[0]
    if ours and theirs and ours != theirs:
        found.append(f"torch {theirs} where the client has {ours}: a job is refused (add torch=={ours} to "
                     "requirements, or --allow-skew)")
    return found


def _public(address: object) -> str | None:
    """``address`` if it is a globally routable one (not private, loopback or link-local)."""
    try:
        parsed = ipaddress.ip_address(str(address))
    except ValueError:
        return None
    return str(parsed) if parsed.is_global else None


def doctor_exit_code(rows: list[DoctorRow]) -> int:
    """0 when every host can run a job (warnings allowed); 6 (a host cannot be used) otherwise."""
    return HostError.exit_code if any(row.status in ("down", "problem") for row in rows) else 0
