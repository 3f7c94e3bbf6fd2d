"""The current round's group connections, shut down from any thread to wake a blocked collective.

A gloo collective cannot be aborted from its own process (``membership`` says what was tried),
but shutting down the sockets its group opened makes a blocked ``recv`` return at once, here and
at the peer. Which sockets: those ``init_process_group`` opened, found by comparing this
process's socket fds (and their inodes) before and after it. NCCL's kernels do not wait on
sockets; its communicator is aborted instead (``ncclCommAbort``).
"""

from __future__ import annotations

import os
import socket
import threading

import torch
import torch.distributed as dist

__all__ = ["GroupSockets", "socket_fds"]


class GroupSockets:
    """One member's current group connections. ``lock`` guards them: the watcher thread shuts
    them while the training thread forms the next group."""

    def __init__(self, backend: str, device: torch.device | None) -> None:
        self._backend = backend
        self._device = device
        self._fds: dict[int, str] = {}  # fd -> its socket inode: the current group's connections
        self.lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._fds)

    def formed(self, before: dict[int, str]) -> None:
        """The group just opened: its connections are the sockets new since ``before``
        (``socket_fds()`` taken before ``init_process_group``). Call with ``lock`` held."""
        self._fds = {fd: inode for fd, inode in socket_fds().items() if before.get(fd) != inode}

    def shut(self) -> None:
        """Shut down the current group's connections: a collective blocked on them fails now.

        ``shutdown``, not ``close``: the fds stay gloo's to close, and a blocked ``recv``
        on them returns at once, here and at the peer. An fd whose inode changed was
        closed and reused: skipped.
        """
        with self.lock:
            sockets, self._fds = self._fds, {}
        if not sockets:
            return
        if self._backend == "nccl" and self._device is not None and dist.is_initialized():
            # NCCL's kernels do not wait on these sockets; aborting the communicator from
            # another thread is what NCCL offers (ncclCommAbort), and the blocked op raises.
            try:
                dist.group.WORLD._get_backend(self._device).abort()  # type: ignore[union-attr]
            except RuntimeError:
                pass
        for fd, inode in sockets.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != inode:
                    continue
                with socket.socket(fileno=os.dup(fd)) as dup:
                    # Never gloo's listening socket: its accept thread treats an error there as
                    # fatal and aborts the process (seen: "accept: Invalid argument", SIGABRT).
                    if not dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue

    def drop(self) -> None:
        """Leave this process's default group so that peers blocked on it fail now.

        First shut down the group's sockets (:meth:`shut`): each peer blocked on a connection
        to us sees it close at once. Destroying the group alone did not do that (torch 2.13):
        its connections close only when the last reference goes, and a failed collective's
        traceback, or DDP's reducer in a reference cycle, keeps one; a peer then waited out
        the whole timeout. A full ``gc.collect()`` would free them, but costs a quarter of a
        second with torch loaded, on every survivor, in the recovery's path. NCCL: abort the
        communicator, which frees one stuck on a dead peer.
        """
        self.shut()
        if not dist.is_initialized():
            return
        group = dist.group.WORLD
        for device in (torch.device("cpu"), self._device):
            if device is None:
                continue
            try:
                group._get_backend(device).abort()  # type: ignore[union-attr]
            except RuntimeError:  # no backend for this device type
                pass
        dist.destroy_process_group()


def socket_fds() -> dict[int, str]:
    """This process's socket fds, each with its inode ("socket:[N]"), from /proc (Linux)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found
