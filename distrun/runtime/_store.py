"""The store process (``--elastic``): the job's rendezvous TCPStore, outside every rank.

Without ``--elastic``, rank 0 hosts the store, as torchrun's agent store: the job ends
with rank 0 anyway. An elastic job must outlive any rank, rank 0 included, so the
launcher that binds the rendezvous socket starts this process on it (locally the
client's launcher; on a cluster the chief host's worker server), and kills it when the
job ends. It does nothing else: no recipe, no events.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

from distrun.protocol.environment import STORE_FD_VAR
from distrun.runtime._process import LaunchEnv, die_with_parent

#: How long a client's call may wait on a key (the same bound the ranks use).
_TIMEOUT = timedelta(seconds=300)


def serve_store() -> None:
    die_with_parent()
    import torch.distributed as dist

    launch = LaunchEnv.from_environ()
    store = dist.TCPStore(launch.master_addr, launch.master_port, None, True, _TIMEOUT, wait_for_workers=False,
                          master_listen_fd=int(os.environ[STORE_FD_VAR]))
    threading.Event().wait()  # until the launcher kills us
    del store
