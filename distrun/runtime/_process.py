"""Process-level set-up of a training process: tie its life to the launcher, open the event pipe.

The launcher's environment variables are read here and nowhere else.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from dataclasses import dataclass

from distrun.protocol import Event, encode_event
from distrun.protocol.environment import EVENT_FD_VAR, INCARNATION_VAR, PARENT_PID_VAR, STORE_FD_VAR, SUPERVISOR_PID_VAR

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    store_fd: int | None
    node_rank: int = 0  # GROUP_RANK: which host of the job this process runs on

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        env = os.environ
        store_fd = env.get(STORE_FD_VAR)
        return cls(
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            node_rank=int(env.get("GROUP_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "0")),
            store_fd=int(store_fd) if store_fd else None,
        )


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the launcher dies; exit now if it already has."""
    parent = os.environ.get(PARENT_PID_VAR)
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(parent):
        os._exit(1)


def match_thread_env() -> None:
    """Size torch's CPU thread pool from OMP_NUM_THREADS, as a fresh interpreter would.

    A rank forked from the warm interpreter inherits the pool size the zygote's
    torch import read from the zygote's environment, not this rank's: without this,
    every local replica would use all the host's cores. A cold rank has not imported
    torch yet here, and reads the variable itself.
    """
    value = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is None or not value.isdigit() or int(value) < 1:
        return
    if torch.get_num_threads() != int(value):
        torch.set_num_threads(int(value))


class EventWriter:
    """Writes events to the launcher's pipe; a no-op outside a launcher (plain python)."""

    def __init__(self, fd: int | None) -> None:
        self._file = os.fdopen(fd, "wb", buffering=0) if fd is not None else None
        self._lock = threading.Lock()

    @classmethod
    def from_environ(cls) -> EventWriter:
        fd = os.environ.pop(EVENT_FD_VAR, None)
        # Not inherited by anything the recipe starts.
        return cls(int(fd) if fd else None)

    def emit(self, event: Event) -> None:
        if self._file is None:
            return
        data = encode_event(event)
        with self._lock:
            try:
                self._file.write(data)
            except BrokenPipeError:
                self._file = None


def incarnation_id(count: int | None = None) -> str:
    """This process's start of its launcher rank (or the ``count``-th start, as the agent names a
    rank its launcher saw die), unique across launchers: ``PID-START.N``, the launcher's pid and
    start time (clock ticks since boot) and the respawn count.

    ``--elastic``: the agent marks a dead rank lost by it (``elastic/lost/RANK/ID``) and members
    wait for no member so marked. The count alone restarts at 0 with a new launcher (a worker
    server restarted by ``distrun up``), whose first rank then read as the lost rank its old
    launcher's first start was: the others closed a round without it (seen in issue 52's chaos
    run, as ``BelowMinimum`` with a live member).
    """
    if count is None:
        count = int(os.environ.get(INCARNATION_VAR, "0"))
    pid = os.environ.get(SUPERVISOR_PID_VAR, "")
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="ascii") as fh:
            start = fh.read().rsplit(")", 1)[1].split()[19]  # field 22: starttime
    except (OSError, ValueError, IndexError):
        start = "?"
    return f"{pid or '?'}-{start}.{count}"
