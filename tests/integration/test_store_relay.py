"""The job store behind its front and relays: torch's own TCPStore, real sockets, a real second user.

A stranger with torch's public store client reads and writes nothing: not through the front
(it cannot prove the secret), not through a host's relay (it is another user), and the
store itself is on loopback. A rank of the job, through its relay, sees the store as always.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from distrun.launch._chief_store import ChiefStore
from distrun.launch._store_relay import StoreFront, StoreRelay, peer_uid

pytestmark = pytest.mark.integration

SECRET = bytes(range(32))


class _Job:
    """A chief's store in its own network (``launch/_chief_store``) with its front on another
    loopback address (the cluster address's stand-in), and another host's relay to the front."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.chief = ChiefStore(self.notes.append)
        # rank 0's way: the store on the chief's socket; its own client lands on the chief's relay
        self.store = dist.TCPStore("127.0.0.1", self.chief.port, None, True, timedelta(seconds=10),
                                   wait_for_workers=False, master_listen_fd=self.chief.listener.fileno())
        listener = socket.socket()
        listener.bind(("127.0.0.2", 0))
        listener.listen(64)
        self.front = StoreFront(listener, SECRET, self.chief.connect, self.notes.append)
        self.relay = StoreRelay.to_front(self.front.address, SECRET, self.notes.append)

    def close(self) -> None:
        self.relay.close()
        self.front.close()
        self.chief.listener.close()
        self.chief.close()


@pytest.fixture(scope="module")
def job() -> Any:
    made = _Job()
    made.store.set("ps/params", "secret weights")
    yield made
    made.close()


def _client(port: int, timeout_s: float = 10.0) -> Any:
    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=timeout_s))


def test_a_rank_through_its_relay_sees_the_store(job: _Job) -> None:
    client = _client(job.relay.port)
    assert client.get("ps/params") == b"secret weights"
    client.set("from/rank", "1")
    assert job.store.get("from/rank") == b"1"
    assert client.add("counter", 5) == 5 and job.store.add("counter", 0) == 5
    client.wait(["ps/params"])


def test_a_stranger_at_the_front_reads_nothing_and_is_named_once(job: _Job) -> None:
    host, port = job.front.address
    for _ in range(2):
        with pytest.raises(dist.DistNetworkError):
            dist.TCPStore(host, port, None, False, timedelta(seconds=2))
    # Raw bytes: a store request, then junk, then a frame announcing 4 GiB.
    for payload in (b"\x00" * 64, b"GET ps/params\r\n", b"\xff\xff\xff\xffxx"):
        with socket.create_connection((host, port), timeout=5) as raw:
            raw.sendall(payload)
            raw.settimeout(6)
            received = b""
            try:
                while chunk := raw.recv(65536):
                    received += chunk
            except OSError:
                pass
            assert b"secret weights" not in received
    assert job.store.get("ps/params") == b"secret weights"
    refused = [note for note in job.notes if note.startswith("refused a store connection from 127.0.0.1")]
    assert len(refused) == 1, job.notes


def test_a_relay_without_the_secret_is_refused(job: _Job) -> None:
    notes: list[str] = []
    wrong = StoreRelay.to_front(job.front.address, b"w" * 32, notes.append)
    try:
        with pytest.raises(dist.DistNetworkError):
            _client(wrong.port, timeout_s=2)
    finally:
        wrong.close()
    assert any("the front failed the handshake" in note for note in notes), notes


@pytest.mark.parametrize("which", ["relay", "chief"])
def test_another_user_on_the_host_is_refused_by_the_relay(job: _Job, which: str) -> None:
    """Another host's relay, and the chief's own, where the chief's ranks reach the store."""
    port = job.relay.port if which == "relay" else job.chief.port
    noted_before = sum(1 for note in job.notes if "(uid 65534)" in note)
    if os.getuid() != 0:
        pytest.fail("this test runs as root, to connect as another user (nobody)")
    read_r, read_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user: a plain socket is all the relay sees of a client
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(b"\x00" * 16)
                conn.settimeout(5)
                got = conn.recv(65536)
            os.write(read_w, b"READ " + got if got else b"CLOSED")
        except OSError as exc:
            os.write(read_w, f"REFUSED {exc}".encode())
        finally:
            os._exit(0)
    os.close(read_w)
    os.waitpid(pid, 0)
    said = os.read(read_r, 65536).decode("latin-1")
    os.close(read_r)
    assert said == "CLOSED" or said.startswith("REFUSED"), said
    named = [note for note in job.notes if "(uid 65534)" in note and "not a process of uid 0" in note]
    assert len(named) == noted_before + 1, job.notes  # this relay's own note


def test_the_peer_uid_is_read_from_the_kernels_socket_table() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        with socket.create_connection(listener.getsockname()):
            conn, _ = listener.accept()
            with conn:
                assert peer_uid(conn) == os.getuid()


def test_a_peer_that_drips_bytes_loses_its_slot_at_the_deadline(job: _Job) -> None:
    """The handshake's 5 s bound is on the whole of it, not on each recv."""
    started = time.monotonic()
    with socket.create_connection(job.front.address, timeout=10) as slow:
        slow.recv(65536)  # the greeting
        slow.settimeout(1.0)
        closed = False
        for _ in range(12):  # a byte a second: each recv's timeout would never fire
            try:
                slow.sendall(b"\x00")
                if slow.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
    assert closed and time.monotonic() - started < 9


def test_the_chief_store_listens_in_a_network_of_its_own(job: _Job) -> None:
    """On the chief's network the store's port number is the relay's, and the relay's only: the
    store itself is reachable only through the holder's connections (the front's and the relay's)."""
    assert job.chief.private, job.notes
    listening = _loopback_listeners()
    assert listening.count(job.chief.port) == 1  # the relay's, not a second socket of the store
    assert os.fstat(job.chief.network.fds[0]).st_ino != os.stat("/proc/self/ns/net").st_ino
    # The chief's rank 0 (the master above) and another rank of the chief's host, both through its relay.
    neighbour = _client(job.chief.port)
    neighbour.set("chief/rank1", "here")
    assert job.store.get("chief/rank1") == b"here" and neighbour.get("ps/params") == b"secret weights"


def _loopback_listeners() -> list[int]:
    """Ports listening on 127.0.0.1 (v4 or v4-mapped v6) in this process's network."""
    ports = []
    for table, loopback in (("/proc/net/tcp", "0100007F"), ("/proc/net/tcp6", "0000000000000000FFFF00000100007F")):
        with open(table, encoding="ascii") as rows:
            next(rows)
            for row in rows:
                local, state = row.split()[1], row.split()[3]
                address, port = local.split(":")
                if state == "0A" and address == loopback:
                    ports.append(int(port, 16))
    return ports


def test_a_chief_store_whose_holder_ended_says_so_once() -> None:
    """Connections already made live on; a new one fails, and the job's log says why, once."""
    notes: list[str] = []
    chief = ChiefStore(notes.append)
    try:
        assert chief.private, notes
        made = chief.connect()  # the store's socket listens inside: the holder connects there
        os.kill(chief.network.holder_pid, signal.SIGKILL)
        while not chief.network.holder_ended():
            time.sleep(0.01)
        for _ in range(2):
            with pytest.raises(OSError):
                chief.connect()
        made.close()
    finally:
        chief.listener.close()
        chief.close()
    gone = [note for note in notes if note.startswith("the store's private network is gone")]
    assert len(gone) == 1, notes


def test_a_relay_that_cannot_reach_the_front_says_why_once() -> None:
    """The rank's own client says only "Connection reset" (the relay closed it), each retry."""
    notes: list[str] = []
    with socket.socket() as gone:  # a front address where nothing listens
        gone.bind(("127.0.0.2", 0))
        address = gone.getsockname()[:2]
    relay = StoreRelay.to_front(address, SECRET, notes.append)
    try:
        with pytest.raises(dist.DistNetworkError):
            _client(relay.port, timeout_s=3)
    finally:
        relay.close()
    dropped = [note for note in notes if "could not carry it on to the store" in note]
    assert len(dropped) == 1 and "Connection refused" in dropped[0], notes
