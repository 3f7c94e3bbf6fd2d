"""The job's store behind an authenticating front: no one without the job secret reaches it.

torch's TCPStore authenticates nothing, and in torch 2.13 it lists its keys to any client
(``TCPStore.list_keys``), so hiding a job's keys under a secret prefix hides nothing (tried:
a bare client listed ``secret/k``). What protects the store is where it can be reached from:

- On the store's host, the store listens on 127.0.0.1 inside a network of its own
  (``launch/_chief_store``; a local job's, in the job's network: ``launch/_netns``). The host's
  own ranks reach it through a :class:`StoreRelay` there.
- A :class:`StoreFront` listens on the cluster address in its place (the rendezvous port).
  A connection is served only after the peer proves the job secret with the control
  plane's mutual HMAC handshake (``protocol/wire``, kind ``job-store``); then its bytes are
  spliced to the loopback store. A refused peer is named once in the job's log.
- On every host, a :class:`StoreRelay` listens on 127.0.0.1 for the host's ranks
  (their MASTER_ADDR/MASTER_PORT), takes only connections from processes of the launcher's
  own user (the kernel's socket table says who owns the peer), and carries each on: to the
  front, proving the secret on the way, or on the chief, into the store's network.

The relay was chosen over a secret key prefix by the measurement above, and over nothing
by what the issue's attacker did: joined a parameter-server job through the store and
rewrote its parameters. Its cost per store round trip is in docs/security.md. What stays
open (gloo's and NCCL's own sockets) is said there too.

torch is never imported here: the launcher runs in the control plane.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

from distrun.protocol.wire import WireError, client_handshake, server_handshake

__all__ = ["STORE_KIND", "StoreFront", "StoreRelay", "UpstreamRefused", "RefusalNotes", "loopback_listener", "peer_uid",
           "deadline"]

STORE_KIND = "job-store"
#: How long a peer may take to prove the secret; a silent peer must not hold a slot for longer.
HANDSHAKE_S = 5.0
#: Handshakes in progress at once; connections past this are closed unanswered.
_MAX_PENDING = 64
_CHUNK = 65536
_ACCEPT_POLL_S = 0.5

Note = Callable[[str], None]
#: Opens a connection onward (to the store, or to the front that leads there).
Connect = Callable[[], socket.socket]


class RefusalNotes:
    """Names each refused peer once in the job's log (an attacker scanning must not flood it)."""

    def __init__(self, note: Note, what: str) -> None:
        self._note = note
        self._what = what
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def refused(self, peer: str, why: str) -> None:
        if self._first(peer):
            self._note(f"refused a {self._what} connection from {peer}: {why}")

    def dropped(self, why: str) -> None:
        """A connection of the job's own closed unserved (the way on failed): said once per reason,
        so a rank that cannot reach the store is not left with torch's "Connection reset" alone."""
        if self._first("dropped: " + why):
            self._note(f"the {self._what} closed a connection of the job's: {why}")

    def _first(self, key: str) -> bool:
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True


@contextlib.contextmanager
def deadline(conn: socket.socket, seconds: float) -> Iterator[None]:
    """Shut ``conn`` down if the block takes longer than ``seconds`` in all (a socket timeout
    bounds one ``recv``; a peer sending a byte at a time would pass every one of them)."""
    timer = threading.Timer(seconds, _shut, args=(conn,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Splices:
    """Open spliced connection pairs, so that closing the front or relay ends them all."""

    def __init__(self) -> None:
        self._open: dict[tuple[socket.socket, socket.socket], int] = {}  # pair -> directions finished
        self._lock = threading.Lock()
        self._closed = False

    def splice(self, a: socket.socket, b: socket.socket) -> None:
        with self._lock:
            if self._closed:
                a.close()
                b.close()
                return
            self._open[(a, b)] = 0
        for src, dst in ((a, b), (b, a)):
            threading.Thread(target=self._copy, args=((a, b), src, dst), name="store-splice", daemon=True).start()

    def _copy(self, pair: tuple[socket.socket, socket.socket], src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:  # a broken side: end both directions, so the other thread's recv returns too
            _shut(src)
            _shut(dst)
        try:
            dst.shutdown(socket.SHUT_WR)  # the other direction may still be answering
        except OSError:
            pass
        with self._lock:
            finished = self._open.get(pair)
            if finished is None:
                return  # close() took it
            if finished == 0:
                self._open[pair] = 1
                return
            del self._open[pair]
        for sock in pair:
            sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs, self._open = list(self._open), {}
        for pair in pairs:
            for sock in pair:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


class _Acceptor:
    """An accept loop on its own thread; each connection is handled on a thread of its own,
    at most ``_MAX_PENDING`` handshakes at once."""

    def __init__(self, listener: socket.socket, handle: Callable[[socket.socket, str], None], name: str,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.listener = listener
        self._handle = handle
        self._on_error = on_error
        self._slots = threading.BoundedSemaphore(_MAX_PENDING)
        self._stopped = threading.Event()
        self.splices = _Splices()
        listener.settimeout(_ACCEPT_POLL_S)
        self._thread = threading.Thread(target=self._accept, name=name, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = self.listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError as exc:
                if self._stopped.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # closed
                if self._on_error is not None:  # out of fds (EMFILE), a peer gone before accept
                    self._on_error(f"accepting: {exc.strerror or exc}")
                time.sleep(_ACCEPT_POLL_S / 5)
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._run, args=(conn, str(peer[0])), name="store-handshake", daemon=True).start()

    def _run(self, conn: socket.socket, peer: str) -> None:
        try:
            self._handle(conn, peer)
        finally:
            self._slots.release()

    def close(self) -> None:
        self._stopped.set()
        try:  # wakes the blocked accept() at once; closing alone leaves it to its poll timeout
            self.listener.shutdown(socket.SHUT_RDWR)  # (0.4 s on every job's end, issue 33)
        except OSError:
            pass
        self.listener.close()
        self._thread.join(timeout=2 * _ACCEPT_POLL_S)
        self.splices.close()


class StoreFront:
    """On the store's host: the rendezvous port, where other hosts' relays prove the secret."""

    def __init__(self, listener: socket.socket, secret: bytes, store: Connect, note: Note) -> None:
        """``listener``: bound to the cluster address and listening; ``store``: opens a connection
        to the job's store on this host (``launch/_chief_store``)."""
        self._secret = secret
        self._store = store
        self._refusals = RefusalNotes(note, "store")
        self.address = listener.getsockname()[:2]
        self._acceptor = _Acceptor(listener, self._serve, "store-front", self._refusals.dropped)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        conn.settimeout(HANDSHAKE_S)
        try:
            with deadline(conn, HANDSHAKE_S):  # the whole handshake, not each recv: no slow drip holds a slot
                server_handshake(conn, self._secret, kind=STORE_KIND)
        except (WireError, OSError) as exc:
            self._refusals.refused(peer, _why(exc))
            conn.close()
            return
        try:
            store = self._store()
        except OSError as exc:
            self._refusals.dropped(f"it could not reach the store for {peer} ({_why(exc)})")
            conn.close()  # the store is gone (the job is ending, or its network's holder ended)
            return
        conn.settimeout(None)
        store.settimeout(None)
        _no_delay(conn, store)
        self._acceptor.splices.splice(conn, store)

    def close(self) -> None:
        self._acceptor.close()


class UpstreamRefused(OSError):
    """The far end of a relay refused it (``peer``, and why): noted once in the job's log."""

    def __init__(self, peer: str, why: str) -> None:
        super().__init__(why)
        self.peer = peer
        self.why = why


class StoreRelay:
    """A loopback port for this host's ranks (processes of the launcher's own uid only), each
    connection carried to the store by ``upstream``: through the chief's front, proving the secret,
    on another host (:meth:`to_front`); into the store's own network on the chief's (``launch/_chief_store``)."""

    def __init__(self, upstream: Connect, note: Note, listener: socket.socket | None = None) -> None:
        """``listener``: bound to 127.0.0.1 and listening (default: a new one on any port)."""
        self._upstream = upstream
        self._refusals = RefusalNotes(note, "store relay")
        if listener is None:
            listener = loopback_listener()
        self.port = int(listener.getsockname()[1])
        self._uid = os.getuid()
        self._acceptor = _Acceptor(listener, self._serve, "store-relay", self._refusals.dropped)

    @classmethod
    def to_front(cls, front: tuple[str, int], secret: bytes, note: Note) -> StoreRelay:
        """On a host without the store: each connection goes to the chief's front and proves ``secret``."""

        def through_front() -> socket.socket:
            sock = socket.create_connection(front, timeout=HANDSHAKE_S)
            try:
                client_handshake(sock, secret, kind=STORE_KIND)
            except (WireError, OSError) as exc:
                sock.close()
                why = f"the front failed the handshake ({_why(exc)})"
                raise UpstreamRefused(f"{front[0]}:{front[1]}", why) from exc
            return sock

        return cls(through_front, note)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        owner = peer_uid(conn)
        if owner != self._uid:
            self._refusals.refused(f"{peer} (uid {owner})", f"not a process of uid {self._uid}")
            conn.close()
            return
        try:
            upstream = self._upstream()
        except UpstreamRefused as exc:
            self._refusals.refused(exc.peer, exc.why)
            conn.close()
            return
        except OSError as exc:
            self._refusals.dropped(f"it could not carry it on to the store ({_why(exc)})")
            conn.close()  # the rank's store client retries, then reports the failure
            return
        upstream.settimeout(None)
        _no_delay(conn, upstream)
        self._acceptor.splices.splice(conn, upstream)

    def close(self) -> None:
        self._acceptor.close()


def loopback_listener(port: int = 0) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:``port`` of this process's network."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", port))
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


def peer_uid(conn: socket.socket) -> int | None:
    """The uid owning the other end of a loopback TCP connection (None if the kernel's
    table does not show it: then the peer is refused)."""
    try:
        peer_host, peer_port = conn.getpeername()[:2]
        _, local_port = conn.getsockname()[:2]
    except OSError:
        return None
    if peer_host != "127.0.0.1":
        return None
    # torch's store client opens an IPv6 socket and connects v4-mapped: its row is in tcp6.
    for table_path, loopback in (("/proc/net/tcp", "0100007F"), ("/proc/net/tcp6", "0000000000000000FFFF00000100007F")):
        wanted = (f"{loopback}:{peer_port:04X}", f"{loopback}:{local_port:04X}")
        try:
            with open(table_path, encoding="ascii") as table:
                next(table, None)
                for line in table:
                    fields = line.split()
                    if len(fields) > 7 and (fields[1], fields[2]) == wanted:
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


def _why(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"it did not prove the job secret within {HANDSHAKE_S:.0f} s"
    text = str(exc) or type(exc).__name__
    return "it did not prove the job secret" if "token" in text else text


def _no_delay(*sockets: socket.socket) -> None:
    """No Nagle delay on store round trips; keepalive, so a host that vanished ends its splice."""
    for sock in sockets:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        except OSError:
            pass
