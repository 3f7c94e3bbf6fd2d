"""The elastic agent process (``--elastic``): the launcher's torch-side helper.

Started by ``launch/_agent.ElasticAgent``, one per launcher. Where the launcher binds the
rendezvous socket (locally the client's launcher, on a cluster the chief host's server),
the agent hosts the job's TCPStore on it, so the store outlives every rank: rank 0
included. Everywhere, it reads ``lost RANK INCARNATION WHY`` lines from its launcher and marks
them on the store (``lost/RANK/INCARNATION`` under the membership's prefix, then bumps
``lost_count``),
which is how survivors learn of a death at once rather than from a beat that stopped.
It runs no recipe and sends no events.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

from distrun.protocol.environment import AGENT_FD_VAR, STORE_FD_VAR
from distrun.runtime._process import LaunchEnv, die_with_parent, incarnation_id
from distrun.strategies.elastic.membership import STORE_PREFIX

#: How long a client's call may wait on a key (the same bound the ranks use).
_TIMEOUT = timedelta(seconds=300)


def serve_agent() -> None:
    die_with_parent()
    import torch.distributed as dist

    launch = LaunchEnv.from_environ()
    listen_fd = os.environ.get(STORE_FD_VAR)
    if listen_fd:
        store = dist.TCPStore(launch.master_addr, launch.master_port, None, True, _TIMEOUT, wait_for_workers=False,
                              master_listen_fd=int(listen_fd))
    else:
        store = dist.TCPStore(launch.master_addr, launch.master_port, None, False, _TIMEOUT)
    marks = dist.PrefixStore(STORE_PREFIX, store)  # the membership's keys (strategies/elastic/membership.py)
    with os.fdopen(int(os.environ[AGENT_FD_VAR]), "rb") as lines:
        for line in lines:
            parts = line.split(maxsplit=3)
            if len(parts) >= 3 and parts[0] == b"lost" and parts[1].isdigit() and parts[2].isdigit():
                why = parts[3].decode("utf-8", "replace").strip() if len(parts) == 4 else "lost"
                marks.set(f"lost/{int(parts[1])}/{incarnation_id(int(parts[2]))}", why or "lost")
                marks.add("lost_count", 1)
    threading.Event().wait()  # the launcher closed its end: it is stopping, and kills us next
