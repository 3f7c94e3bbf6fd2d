"""``distrun doctor [CLUSTER]``: one row per host of what makes or breaks a job there.

Every host is asked at once, each with its own bounds, so an unreachable host is a row
that says why ("down"), never a hang. Asked of each host's worker server:

- SSH and the server itself (a host without one is "down": run ``distrun up``);
- python, distrun (it must be the client's version), and what torch sees: its version,
  CUDA, NCCL, GPUs (a short-lived ``python -c`` of the server's interpreter);
- free disk in the host's distrun folder, and the host's clock against this machine's
  (the midpoint of a quick round trip);
- the interface its route to the chief leaves by, and whether it can open a TCP
  connection to a port the chief listens on for the purpose, as ranks will to the
  rendezvous port (``network.port_range`` is honoured).

Problems (exit 6): down, a distrun version that differs, torch that does not import, the
chief's port not reached. Warnings (exit 0): clock skew over 1 s, under 1 GiB free, fewer
GPUs than the cluster file's ``gpus:``.
"""

from __future__ import annotations

import ipaddress
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from distrun._version import __version__
from distrun.client._links import HostLink
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
    with ThreadPoolExecutor(max_workers=min(32, len(cluster.hosts))) as pool:
        return list(pool.map(lambda host: _row(cluster, host, probe), cluster.hosts))


def _row(cluster: ClusterSpec, host: HostSpec, probe: _Probe) -> DoctorRow:
    link = HostLink(cluster, host)
    try:
        link.open()
        assert link.info is not None
        t0 = time.time()
        their_time = float(link.call("doctor", clock_only=True)["time"])
        t1 = time.time()
        facts = link.call("doctor", chief=probe.chief_address, port=probe.port)
    except HostError as exc:
        return DoctorRow(host=host.label, status="down", problems=(exc.reason,))
    finally:
        link.close()
    problems, warnings = [], []
    if link.info.version != __version__:
        problems.append(f"distrun {link.info.version} there, {__version__} here: `distrun up` installs this one")
    if facts.get("torch_error"):
        problems.append(f"torch: {facts['torch_error']}")
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
    gpus = facts.get("gpus")
    if host.gpus and (gpus or 0) < host.gpus:
        warnings.append(f"the cluster file says gpus: {host.gpus}; torch sees {gpus or 0}")
    return DoctorRow(
        host=host.label, status="problem" if problems else "warn" if warnings else "ok",
        python=link.info.python, distrun=link.info.version, torch=facts.get("torch"), cuda=facts.get("cuda"),
        nccl=facts.get("nccl"), gpus=gpus, free_bytes=free, skew_s=skew, interface=facts.get("interface"),
        reaches_chief=None if probe.port is None else reach is None,
        problems=tuple(problems), warnings=tuple(warnings))


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
