"""Warm local start: a local job's ranks forked from the embedded server's warm interpreter.

`distrun up` with no file starts a worker server on this machine, and that
server keeps a zygote that has imported torch. `distrun train` without
``--cluster`` asks the server (an authenticated connection, like any client)
where its zygote listens and gives the local launcher a ``ZygoteStarter`` for
it. Nothing else changes: this process still runs the launcher, so the live
view, Ctrl-C, checkpoint paths, errors and exit codes are the cold local
job's, not a cluster job's (no bundle, no results copied home). Only the
interpreter start-up and the torch import are skipped.

A warm start is used only where it gives the same job as a cold one: the
server runs this very interpreter (the same ``sys.executable``, so the same
packages) and this version of distrun. A job started right after ``distrun up``
waits (up to ``WARM_WAIT_S``) while the zygote is still importing torch, rather than
start cold while ``status`` already says up. Otherwise, with no server, the job
starts cold, and ``reason`` says why.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from distrun._version import __version__
from distrun.client._links import connect, open_remote, read_server_state
from distrun.config import ClusterSpec
from distrun.errors import HostError
from distrun.launch import Starter, ZygoteStarter

__all__ = ["WarmStart", "find_warm_start", "WARM_WAIT_S"]

#: How long a local job waits for a zygote that is still starting (importing torch: 2-5 s here).
WARM_WAIT_S = 20.0


@dataclass(frozen=True)
class WarmStart:
    """How a local job starts: ``starter`` is None for a cold start, and ``reason`` says why."""

    starter: Starter | None
    reason: str = ""
    #: A local server exists but cannot start this job warm: worth telling the user why.
    noteworthy: bool = False

    @property
    def warm(self) -> bool:
        return self.starter is not None


def find_warm_start(cluster: ClusterSpec) -> WarmStart:
    """The embedded server's zygote, if it can start this job's ranks exactly as a cold start would.

    ``cluster``: the embedded default (``local_cluster``); a file's cluster is never used here.
    """
    if not cluster.local:
        raise ValueError("a warm local start uses the embedded local cluster only")
    host = cluster.hosts[0]
    remote = open_remote(cluster, host)
    state = read_server_state(remote, cluster.host_state_dir(host))
    if state is None:
        return WarmStart(None, "no local server (`distrun up` starts one)")
    if state.version != __version__:
        return WarmStart(None, f"the local server runs distrun {state.version}, this is {__version__}; "
                               "`distrun up` replaces it", noteworthy=True)
    try:
        with connect(remote, state, host.label) as client:
            zygote = client.call("warm")
            deadline = time.monotonic() + WARM_WAIT_S
            while not zygote.get("ready") and zygote.get("starting") and time.monotonic() < deadline:
                time.sleep(0.2)  # right after `distrun up`: it is importing torch, a few seconds
                zygote = client.call("warm")
    except HostError as exc:
        return WarmStart(None, f"the local server does not answer ({exc.reason})", noteworthy=True)
    if not zygote.get("ready"):
        why = (f"not ready after {WARM_WAIT_S:.0f} s" if zygote.get("starting")
               else "not running (see server.log in $DISTRUN_HOME)" if zygote.get("starting") is False
               else "not ready yet")
        return WarmStart(None, f"the local server's warm interpreter is {why}", noteworthy=True)
    python = str(zygote.get("python", ""))
    if not _same_file(python, sys.executable):
        return WarmStart(None, f"the local server runs {python}, this is {sys.executable}", noteworthy=True)
    return WarmStart(ZygoteStarter(str(zygote["socket"]), int(zygote["pid"])))


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
