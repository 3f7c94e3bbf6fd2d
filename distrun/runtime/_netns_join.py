"""Joining the job's private network, first thing in a process the launcher started (``launch/_netns``).

setns into a user namespace needs a single-threaded process, so this runs before anything that
could start a thread (torch's import, above all): in ``runtime/__main__`` of a fresh interpreter,
and of a child the zygote forked (one thread, as any fork's child). It imports only ``os`` and
``ctypes``. A process already in the namespace (a rank the elastic agent's process group holds)
leaves it at that.
"""

from __future__ import annotations

import ctypes
import os
import sys

from distrun.protocol.environment import NETNS_FDS_VAR

__all__ = ["join_private_network"]

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000


def join_private_network() -> None:
    """Join the namespace NETNS_FDS_VAR names (``NET_FD,USER_FD``; -1: no user namespace), or
    leave with a line that says why: outside it, the job's store cannot be reached."""
    value = os.environ.pop(NETNS_FDS_VAR, "")  # this process's: its own children inherit the namespace
    if not value:
        return
    try:
        net_fd, user_fd = (int(part) for part in value.split(","))
        try:
            if os.fstat(net_fd).st_ino != os.stat("/proc/self/ns/net").st_ino:
                libc = ctypes.CDLL(None, use_errno=True)
                for fd, kind, name in ((user_fd, _CLONE_NEWUSER, "user"), (net_fd, _CLONE_NEWNET, "network")):
                    if fd >= 0 and libc.setns(fd, kind) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into the job's {name} namespace: "
                                                          f"{os.strerror(ctypes.get_errno())}")
        finally:
            for fd in (net_fd, user_fd):
                if fd >= 0:
                    os.close(fd)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"[distrun] cannot join the job's private network: {exc}\n")
        sys.stderr.flush()
        os._exit(70)
