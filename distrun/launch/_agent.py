"""The elastic agent process of one launcher (``--elastic``): the store's host, and the
voice that tells the job a rank of this host is gone.

torch.distributed.elastic's split: an agent per host beside the workers. Each elastic
launcher starts one (``python -m distrun.runtime`` in the agent role, forked warm where
it can be; the launcher itself never imports torch):

- On the launcher that binds the rendezvous socket (locally the client's, on a cluster
  the chief host's server), it hosts the job's TCPStore, so the store outlives every rank.
- On every launcher, it is a client of that store. When the launcher sees one of its ranks
  die, it writes ``lost RANK INCARNATION`` on the agent's pipe, and the agent sets
  ``elastic/lost/RANK/INCARNATION``. The survivors' round then closes at once instead of
  waiting for the dead rank's beat to go stale (``strategies/elastic/membership.py``): the launcher
  sees a death within one tick (50 ms); a stale beat takes a second to be sure of.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Mapping, Sequence

from distrun.launch._starter import Handle, Starter, ZygoteUnavailable
from distrun.protocol.environment import AGENT_FD_VAR, PARENT_PID_VAR, STORE_FD_VAR, STORE_ROLE_VAR

__all__ = ["ElasticAgent"]


class ElasticAgent:
    """One launcher's agent process; ``lost()`` is called from the launcher's supervising thread."""

    def __init__(self, starter: Starter, argv: Sequence[str], env: Mapping[str, str], cwd: str | None,
                 listener: socket.socket | None) -> None:
        """``env``: the job's environment with a rank's variables (MASTER_ADDR/PORT);
        ``listener``: the rendezvous socket when this launcher hosts the store."""
        read_end, self._write_end = os.pipe()
        env = dict(env)
        env[STORE_ROLE_VAR] = "1"
        env[AGENT_FD_VAR] = str(read_end)
        passed = [read_end]
        if listener is not None:
            env[STORE_FD_VAR] = str(listener.fileno())
            passed.append(listener.fileno())
        else:
            env.pop(STORE_FD_VAR, None)
        self.starter = starter
        try:
            env[PARENT_PID_VAR] = str(starter.parent_pid())
            self._handle: Handle | None = starter.start(argv, env, cwd, stdout=2, stderr=2, pass_fds=passed)
        except ZygoteUnavailable:
            self.starter = starter.cold()  # the caller starts cold from now on too
            env[PARENT_PID_VAR] = str(os.getpid())
            self._handle = self.starter.start(argv, env, cwd, stdout=2, stderr=2, pass_fds=passed)
        finally:
            os.close(read_end)

    def lost(self, rank: int, incarnation: int, why: str) -> None:
        """Tell the job that ``rank`` (its ``incarnation``-th start) is gone, and ``why`` (one line,
        what membership events say). Never blocks for long: a line is far below the pipe's
        buffer, and a dead agent is ignored (beats still tell)."""
        reason = " ".join(why.split())[:200]
        try:
            os.write(self._write_end, f"lost {rank} {incarnation} {reason}\n".encode())
        except OSError:
            pass

    def stop(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            os.close(self._write_end)
        except OSError:
            pass
        try:
            os.killpg(handle.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        handle.wait()
