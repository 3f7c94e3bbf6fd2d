"""Finding every process a server left behind, so `down` can check instead of assume.

The server puts ``DISTRUN_SERVER_DIR=<its state folder>`` in its own
environment; training processes inherit it. A sweep lists the processes whose
environment carries this host's marker (other users' processes cannot be read
and are not ours), and with ``kill`` ends them: SIGTERM, then SIGKILL after a
grace period.
"""

from __future__ import annotations

import os

import psutil

SERVER_DIR_ENV = "DISTRUN_SERVER_DIR"


def find(state_dir: str) -> list[psutil.Process]:
    marker = os.path.abspath(state_dir)
    me = os.getpid()
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == me or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(SERVER_DIR_ENV) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def sweep(state_dir: str, *, kill: bool, grace_s: float = 3.0) -> dict[str, list[int]]:
    """Return ``{"found": pids, "left": pids}``; with ``kill``, end them first."""
    procs = find(state_dir)
    found = [proc.pid for proc in procs]
    if kill and procs:
        for proc in procs:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=grace_s)
    left = [proc.pid for proc in find(state_dir)]
    return {"found": found, "left": left}
