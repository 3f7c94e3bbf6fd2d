"""The worker server's port refuses everything but an authenticated peer, and keeps serving."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from distrun.client._server_client import ServerClient
from distrun.errors import HostError
from distrun.protocol.wire import MAX_AUTH_FRAME_BYTES, client_handshake, recv_frame, send_frame
from tests.cluster.conftest import kill_all


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict]:
    state_dir = tmp_path / "state"
    started = subprocess.run([sys.executable, "-m", "distrun.server", "start", "--state-dir", str(state_dir)],
                             input="{}", capture_output=True, text=True, timeout=30)
    assert started.returncode == 0, started.stderr
    state = json.loads((state_dir / "server.json").read_text())
    try:
        yield state
    finally:
        kill_all(tmp_path)


def _connect(state: dict) -> socket.socket:
    return socket.create_connection(("127.0.0.1", state["port"]), timeout=10)


def _still_serving(state: dict) -> None:
    with ServerClient(_connect(state), state["token"], "test") as client:
        info, _ = client.status()
    assert info.pid == state["pid"]


def _closed(sock: socket.socket) -> bool:
    try:
        while True:
            if sock.recv(65536) == b"":
                return True
    except ConnectionResetError:
        return True


def test_raw_bytes_are_refused(server: dict) -> None:
    with _connect(server) as sock:
        recv_frame(sock)  # the server's challenge
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # 'GET ' read as a length: 1.2 GB, over the cap
        assert _closed(sock)
    _still_serving(server)


def test_a_wrong_token_is_refused(server: dict) -> None:
    with _connect(server) as sock:
        with pytest.raises(HostError, match="refused us"):
            ServerClient(sock, "00" * 32, "test")
    with _connect(server) as sock:  # the right token with a forged MAC is the same thing
        with pytest.raises(Exception, match="authentication failed"):
            client_handshake(sock, os.urandom(32))
    _still_serving(server)


def test_an_oversized_auth_frame_is_refused_unread(server: dict) -> None:
    with _connect(server) as sock:
        recv_frame(sock)
        sock.sendall(struct.pack(">I", MAX_AUTH_FRAME_BYTES + 1) + b"{" * 64)
        assert _closed(sock)
    with _connect(server) as sock:
        recv_frame(sock)
        sock.sendall(struct.pack(">I", 2**31))  # claims 2 GiB; nothing is allocated or read
        assert _closed(sock)
    _still_serving(server)


def test_requests_before_authentication_are_not_answered(server: dict) -> None:
    with _connect(server) as sock:
        recv_frame(sock)
        send_frame(sock, {"id": 1, "op": "shutdown"})  # a request in place of the auth frame
        answer = recv_frame(sock)
        assert answer == {"ok": False, "error": "this server speaks protocol 1"}
        assert _closed(sock)
    _still_serving(server)


def test_an_authenticated_client_gets_clear_errors_and_the_server_survives(server: dict) -> None:
    with ServerClient(_connect(server), server["token"], "test") as client:
        with pytest.raises(HostError, match="unknown request 'rm -rf'"):
            client.call("rm -rf")
        info, rtt_ms = client.status()  # same connection still works
        assert info.version == "0.1.0" and rtt_ms > 0


def test_a_flood_of_unauthenticated_connections_does_not_lock_out_the_client(server: dict) -> None:
    """300 connections at once, half silent and half sending a few bytes of junk, all held open:
    the authenticated client still gets its answers (the pending-handshake bound evicts the
    oldest connection rather than refusing the newest)."""
    flood = []
    try:
        for index in range(300):
            sock = _connect(server)
            if index % 2:
                sock.sendall(b"\x00\x00")  # half a length prefix, then nothing
            flood.append(sock)
        for _ in range(5):
            _still_serving(server)  # each within the client's own 10 s connect/handshake timeouts
            flood.append(_connect(server))  # the flood goes on between the client's calls
    finally:
        for sock in flood:
            sock.close()
    _still_serving(server)
