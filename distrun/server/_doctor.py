"""What ``distrun doctor`` asks a worker server: the facts that make or break a job here.

Besides, the environment the server (and so every rank) runs in: its name, when `up` built
one (``workdir/.envs/<name>/bin/python``, issue 49), so ``doctor`` can show it beside the
versions a job's skew checks compare (``client/_skew``); and the host's installer: the one
that built that environment, else what the cluster's ``installer:`` resolves to here.

The server never imports torch (the control plane's rule), so what torch sees (its
version, CUDA, NCCL, GPUs) is asked of a short-lived ``python -c`` with the server's own
interpreter: the one training processes use. Every probe is bounded in time: a doctor
row may say "failed", never hang.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from distrun.server._net import address_to_bind, interface_towards

__all__ = ["doctor_facts", "ProbeListener"]

_TORCH_PROBE = """
import json, torch
cuda = torch.cuda.is_available()
nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and hasattr(torch.cuda, "nccl") else None
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
                  "gpus": torch.cuda.device_count() if cuda else 0, "nccl": nccl}))
"""
#: Bounds: importing torch takes seconds on a cold disk; a TCP connect to the chief, a few.
_TORCH_PROBE_S = 60.0
_CONNECT_S = 3.0


#: ``client/_env_collect.MARKER``: written last into an environment `up` built, naming its installer.
_ENV_MARKER = ".distrun-ready"
_UV_VERSION_S = 10.0


def doctor_facts(state_dir: Path, chief: str | None, port: int | None, installer: str = "auto") -> dict[str, Any]:
    """Facts of this host; ``chief``/``port``: the chief's probe listener, to try to reach;
    ``installer``: the cluster file's ``installer:`` (auto, uv or pip)."""
    facts: dict[str, Any] = {"time": time.time(), "free_bytes": shutil.disk_usage(state_dir).free,
                             "environment": environment_name(sys.executable), "python_full": platform.python_version(),
                             "installer": installer_here(sys.executable, installer)}
    facts.update(_torch_facts())
    if chief:
        facts["interface"] = interface_towards(chief)
        facts["data_address"] = address_to_bind(chief) if chief not in ("127.0.0.1", "localhost") else "127.0.0.1"
        facts["reaches_chief"] = _reaches(chief, port) if port else None
    return facts


def environment_name(executable: str) -> str | None:
    """The environment ``executable`` belongs to, if `up` built it (``.../.envs/<name>/bin/python``); None: the
    host's python as is. The path as run, not resolved: an environment's python is a link to its base."""
    parts = os.path.normpath(executable).split(os.sep)
    if len(parts) >= 4 and parts[-4] == ".envs" and parts[-2] == "bin":
        return parts[-3]
    return None


def installer_here(executable: str, choice: str) -> str | None:
    """What installs this host's environments: in one `up` built, the installer its marker names
    ("uv 0.9.2" or "pip"); else what ``installer: choice`` resolves to here, by
    ``client/_env_host._find_uv``'s rule (that file is shipped to hosts as source, so it is not
    imported here): uv on PATH, beside this python, or this python's ``uv`` package, else pip.
    None: ``installer: uv`` and no uv here (a build would fail)."""
    if environment_name(executable) is not None:
        try:
            with open(os.path.join(os.path.dirname(os.path.dirname(os.path.normpath(executable))), _ENV_MARKER)) as f:
                said = json.load(f).get("installer")
            if isinstance(said, str) and said:
                return said
        except (OSError, ValueError, AttributeError):
            pass  # an environment from before markers named it: resolved as for a new one
    if choice == "pip":
        return "pip"
    found = shutil.which("uv")
    beside = os.path.join(os.path.dirname(executable), "uv")
    if found is None and os.access(beside, os.X_OK):
        found = beside
    if found is None:
        try:
            from uv import find_uv_bin  # type: ignore[import-not-found]

            found = find_uv_bin()
        except Exception:  # noqa: BLE001 - no uv package, or one without its binary: pip
            found = None
    if found is None:
        return None if choice == "uv" else "pip"
    try:
        said = subprocess.run([found, "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True,  # noqa: S603
                              timeout=_UV_VERSION_S, check=False).stdout.split()
    except (OSError, subprocess.SubprocessError):
        said = []
    return "uv " + said[1] if len(said) >= 2 and said[0] == "uv" else "uv"


def _torch_facts() -> dict[str, Any]:
    try:
        done = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True,  # noqa: S603
                              timeout=_TORCH_PROBE_S, check=False)
    except subprocess.TimeoutExpired:
        return {"torch_error": f"importing torch took over {_TORCH_PROBE_S:.0f} s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"torch_error": last[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _reaches(host: str, port: int) -> str | None:
    """None if a TCP connection to ``host:port`` opens; else why not."""
    try:
        with socket.create_connection((host, port), timeout=_CONNECT_S):
            return None
    except OSError as exc:
        return str(exc) or type(exc).__name__


class ProbeListener:
    """On the chief: a port the other hosts try, as ranks will try the rendezvous port.

    It binds ``address`` (the chief's cluster address, as the rendezvous does), accepts and
    closes connections for ``lifetime_s`` (it reads nothing and sends nothing), then closes.
    """

    def __init__(self, address: str, port_range: tuple[int, int] | None, lifetime_s: float) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for port in ([0] if port_range is None else range(port_range[0], port_range[1] + 1)):
            try:
                self._sock.bind((address, port))
                break
            except OSError:
                continue
        else:
            self._sock.close()
            raise OSError(f"no free port in {port_range[0]}-{port_range[1]}")  # type: ignore[index]
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self._until = time.monotonic() + lifetime_s
        threading.Thread(target=self._serve, name="doctor-probe", daemon=True).start()

    def _serve(self) -> None:
        with self._sock:
            while time.monotonic() < self._until:
                try:
                    conn, _ = self._sock.accept()
                except OSError:
                    continue
                conn.close()
