"""A local job's own network: its ranks reach each other, and only each other, on loopback.

torch's TCPStore and gloo's pairs listen on 127.0.0.1 and authenticate nobody, and every user
of a machine can reach its loopback: on a shared lab box another user listed a local job's store
keys (issue 33). A network namespace of the job's own has a loopback of its own, which no other
process of the machine can reach, whoever runs it.

How. A holder process (``python -S``, about 20 ms) unshares a network namespace (as a user that is
not root, inside a user namespace of its own that maps its uid to itself: no privilege needed),
brings ``lo`` up, and makes the job's listening sockets in it on request, handing each over by
SCM_RIGHTS: the store's socket lives in the namespace while the launcher holds it. Every process
the launcher starts (ranks, the elastic agent; cold or forked by the zygote) gets the namespace as
open files (``/proc/HOLDER/ns/net`` and ``ns/user``) and joins it first thing, while it is still
single-threaded, as setns requires (``runtime/_netns_join``). The launcher stays outside: it reads
the ranks through pipes and their stacks through ptrace, neither of which a namespace changes.

What it costs: no way out. A rank cannot reach the network (a tracker's server, a download), so a
job whose trackers need one keeps the machine's network, and ``DISTRUN_NETWORK=host`` asks for it
(the client decides: ``client/_network``). Where user namespaces are off (a sysctl, some container
runtimes) the holder cannot start; the job then runs on the machine's loopback, as before, and says
so in one line (docs/security.md#co-tenants).
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence

from distrun.launch._starter import Handle, Starter
from distrun.launch._store_relay import loopback_listener
from distrun.protocol.environment import NETNS_FDS_VAR

__all__ = ["PrivateNetwork", "NetworkUnavailable", "JoiningStarter", "store_socket"]

#: The holder: unshare, loopback up, then a socket made inside for each request of three bytes (``L`` and a
#: port: listening on 127.0.0.1 there; ``C`` and a port: connected to 127.0.0.1 there), handed back with
#: ``s`` (or ``e`` and the errno); it ends when the launcher closes the channel or dies (PR_SET_PDEATHSIG).
_HOLDER = r"""
import array, ctypes, fcntl, os, signal, socket, struct, sys
# Slurm signals every process of a job step (SIGUSR1, its warning before the end): the ranks
# checkpoint, and their store must stay reachable while they leave together.
for name in ("SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
channel = socket.socket(fileno=int(sys.argv[1]))
step = "start"
try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9)
    if os.getppid() != int(sys.argv[2]):
        sys.exit(0)
    uid, gid = os.getuid(), os.getgid()
    step = "unshare"
    if libc.unshare(0x40000000 | (0 if uid == 0 else 0x10000000)) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    if uid != 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            step = "writing " + name
            with open("/proc/self/" + name, "w") as handle:
                handle.write(text)
    step = "bringing lo up"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    flags = struct.unpack("16sH22x", fcntl.ioctl(probe, 0x8913, struct.pack("16sH22x", b"lo", 0)))[1]
    fcntl.ioctl(probe, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))
    probe.close()
except Exception as exc:
    channel.sendall(f"error {step}: {exc}\n".encode())
    sys.exit(3)
channel.sendall(b"ok\n")
while True:
    request = channel.recv(3, socket.MSG_WAITALL)
    if len(request) != 3:
        break
    op, port = request[:1], struct.unpack("!H", request[1:])[0]
    try:
        if op == b"L":
            made = socket.socket()
            made.bind(("127.0.0.1", port))
            made.listen(1024)
        else:
            made = socket.create_connection(("127.0.0.1", port), timeout=5)
            made.settimeout(None)
    except OSError as exc:
        channel.sendall(b"e" + struct.pack("!H", exc.errno or 0))
        continue
    channel.sendmsg([b"s\0\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [made.fileno()]))])
    made.close()
"""

_START_S = 10.0


class NetworkUnavailable(RuntimeError):
    """No private network here (user namespaces off, no /proc); why, in a few words."""


class PrivateNetwork:
    """One job's network namespace, held open by the holder process until ``close()``."""

    def __init__(self, holder: subprocess.Popen, channel: socket.socket) -> None:
        self._holder = holder
        self._channel = channel
        self._lock = threading.Lock()
        kinds = ("net",) if os.getuid() == 0 else ("net", "user")
        opened: list[int] = []
        try:
            for kind in kinds:
                opened.append(os.open(f"/proc/{holder.pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            for fd in opened:
                os.close(fd)
            raise
        self.fds: tuple[int, ...] = tuple(opened)
        #: what a process reads from NETNS_FDS_VAR: the net namespace's fd, then the user's (-1: none)
        self.env_value = f"{opened[0]},{opened[1] if len(opened) > 1 else -1}"

    @classmethod
    def open(cls) -> PrivateNetwork:
        ours, theirs = socket.socketpair()
        try:
            holder = subprocess.Popen(  # noqa: S603 - our own program, no shell
                # -I: no working folder on sys.path (a recipe's socket.py), no PYTHON* variables; -S: no site.
                [sys.executable, "-I", "-S", "-c", _HOLDER, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            ours.close()
            raise NetworkUnavailable(f"cannot start its holder: {exc}") from None
        finally:
            theirs.close()
        ours.settimeout(_START_S)
        try:
            said = ours.recv(200).decode(errors="replace").strip()
        except OSError as exc:
            said = f"error no answer: {exc}"
        if said != "ok":
            ours.close()
            with contextlib.suppress(OSError):
                holder.kill()
            holder.wait()
            raise NetworkUnavailable(said.removeprefix("error ") or "its holder ended")
        try:
            return cls(holder, ours)
        except BaseException as exc:
            ours.close()
            holder.kill()
            holder.wait()
            if isinstance(exc, OSError):
                raise NetworkUnavailable(f"cannot open its namespace: {exc}") from None
            raise

    def listener(self, port: int = 0) -> socket.socket:
        """A socket listening on 127.0.0.1:``port`` inside the namespace (the store's; 0: any port)."""
        return self._made(b"L", port)

    def connect(self, port: int) -> socket.socket:
        """A connection to 127.0.0.1:``port`` inside the namespace, for a process outside it: the
        chief host's front and relay reach the job's store this way (``launch/_chief_store``)."""
        return self._made(b"C", port)

    def _made(self, op: bytes, port: int) -> socket.socket:
        with self._lock:  # one request at a time: the relay's and the front's threads share the channel
            if self._channel.fileno() < 0:
                raise OSError(errno.EBADF, "the job's private network is closed")
            try:
                self._channel.sendall(op + struct.pack("!H", port))
                data, ancillary, _flags, _address = self._channel.recvmsg(3, socket.CMSG_SPACE(4))
            except OSError:  # a late answer would be read as the next request's: no next request
                self._channel.close()
                raise
            if len(data) != 3:  # the holder ended (EOF), or an answer cut short
                self._channel.close()
        fds = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            code = struct.unpack("!H", data[1:3])[0] if data[:1] == b"e" and len(data) == 3 else 0
            why = os.strerror(code) if code else "ended"
            raise OSError(code, f"the private network's holder made no socket ({why})")
        return socket.socket(fileno=fds[0])

    @property
    def holder_pid(self) -> int:
        return self._holder.pid

    def holder_ended(self) -> bool:
        return self._holder.poll() is not None

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = ()
        with contextlib.suppress(OSError):
            self._channel.shutdown(socket.SHUT_RDWR)  # a request in flight on another thread returns
        with self._lock:
            self._channel.close()  # the holder reads EOF and ends; the namespace ends with its last process
        try:
            self._holder.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._holder.kill()
            self._holder.wait()


class JoiningStarter:
    """A starter whose every process joins ``network`` first (``runtime/_netns_join``)."""

    def __init__(self, inner: Starter, network: PrivateNetwork) -> None:
        self.inner = inner
        self.network = network
        self.warm = inner.warm

    def parent_pid(self) -> int:
        return self.inner.parent_pid()

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, *, stdout: int, stderr: int,
              pass_fds: Sequence[int]) -> Handle:
        # The namespace's only interface (the client kept the machine's network for a job that named another).
        joined = {**env, NETNS_FDS_VAR: self.network.env_value, "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        return self.inner.start(argv, joined, cwd, stdout=stdout, stderr=stderr,
                                pass_fds=[*pass_fds, *self.network.fds])

    def cold(self) -> JoiningStarter:
        return JoiningStarter(self.inner.cold(), self.network)


def store_socket(private: bool, note: Callable[[str], None]) -> tuple[socket.socket, PrivateNetwork | None]:
    """The store's listening socket on 127.0.0.1: in a private network of its own when ``private``
    and one can be made (the network, to join and to close), else on the machine's loopback,
    which ``note`` says in one line when a private one was asked for."""
    if private:
        network: PrivateNetwork | None = None
        try:
            network = PrivateNetwork.open()
            return network.listener(), network
        except (NetworkUnavailable, OSError) as exc:
            if network is not None:
                network.close()
            note(f"the ranks share this machine's loopback, which its other users can reach: no private network "
                 f"here ({exc}); docs/security.md#co-tenants")
    return loopback_listener(), None
