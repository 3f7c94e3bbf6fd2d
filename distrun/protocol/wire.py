"""The control plane's wire: length-prefixed JSON frames after a mutual HMAC handshake.

A worker server runs code it is sent, so nothing reaches it before the peer has
proven it holds the server's token, and the server parses nothing but one
length-capped frame until then::

    server -> client   {"distrun": "worker-server", "protocol": 1, "nonce": <32 random bytes, hex>}
    client -> server   {"protocol": 1, "nonce": <32 bytes, hex>,            (at most 512 bytes)
                        "mac": HMAC-SHA256(token, "client" | server nonce | client nonce)}
    server -> client   {"ok": true, "mac": HMAC-SHA256(token, "server" | client nonce | server nonce)}

The token itself never crosses the wire; both sides compare with
``hmac.compare_digest``; the client checks the server's answer too, so a process
that squats on the port cannot pose as the server. After the handshake every
message is a frame: a 4-byte big-endian length, then one UTF-8 JSON object. JSON
only: nothing on the control plane is ever unpickled.

Streams are anything with ``sendall``/``recv``/``close``: a socket on the host,
or the paramiko channel that carries it through SSH to the client.

The data plane reuses the same handshake with the job's secret as the token and its own
``kind`` in the greeting (``job-store`` for the store's front, ``link-probe``), so a peer
that holds the secret for one purpose cannot be mistaken for another's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any, Protocol

from distrun.errors import DistrunError

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_AUTH_FRAME_BYTES",
    "MAX_FRAME_BYTES",
    "Stream",
    "WireError",
    "AuthError",
    "send_frame",
    "recv_frame",
    "close",
    "server_handshake",
    "client_handshake",
    "mac",
]

PROTOCOL_VERSION = 1
MAX_AUTH_FRAME_BYTES = 512
MAX_FRAME_BYTES = 16 * 1024 * 1024
NONCE_BYTES = 32
_HEADER = struct.Struct(">I")
_SERVER_KIND = "worker-server"


class Stream(Protocol):
    def sendall(self, data: bytes, /) -> Any: ...
    def recv(self, size: int, /) -> bytes: ...
    def settimeout(self, timeout: float | None, /) -> None: ...
    def close(self) -> None: ...


class WireError(DistrunError):
    """The peer broke the protocol: short read, oversized frame, not JSON."""


class AuthError(WireError):
    """The peer could not prove it holds the token (or speaks another protocol version)."""


def send_frame(stream: Stream, message: dict[str, Any]) -> None:
    # NaN and Inf pass as values (a ``--on-nonfinite warn`` step's loss), as in events.ndjson: both
    # ends are distrun's, and Python's json reads them back; a refused frame would end a `follow`.
    payload = json.dumps(message, separators=(",", ":"), allow_nan=True).encode()
    if len(payload) > MAX_FRAME_BYTES:
        raise WireError(f"message of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    stream.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(stream: Stream, max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """Read one frame; refuse a length above ``max_bytes`` before reading its body."""
    (length,) = _HEADER.unpack(_recv_exact(stream, _HEADER.size))
    if length > max_bytes:
        raise WireError(f"frame of {length} bytes exceeds the {max_bytes}-byte limit")
    payload = _recv_exact(stream, length)
    try:
        message = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise WireError("frame is not UTF-8 JSON") from None
    except RecursionError:  # json's scanner recurses once per nesting level
        raise WireError("frame is JSON nested too deeply") from None
    if not isinstance(message, dict):
        raise WireError("frame is not a JSON object")
    return message


def close(stream: Stream) -> None:
    """Close ``stream`` so that a thread blocked reading it wakes (a socket's ``close`` alone does
    not wake a ``recv`` in another thread; ``shutdown`` does)."""
    shutdown = getattr(stream, "shutdown", None)
    try:
        if shutdown is not None:
            shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (any more)
    try:
        stream.close()
    except OSError:
        pass


def _recv_exact(stream: Stream, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = stream.recv(size - len(chunks))
        if not chunk:
            raise WireError("connection closed" if not chunks else "connection closed mid-frame")
        chunks += chunk
    return bytes(chunks)


def mac(token: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``label`` and ``parts`` under ``token``: every proof on distrun's wires."""
    return hmac.new(token, label + b"".join(parts), hashlib.sha256).digest()


def _label(side: bytes, kind: str) -> bytes:
    """The MAC's label: the side, and the kind where it is not the control plane's (whose
    proofs stay as they were, so servers already running keep answering clients)."""
    return side if kind == _SERVER_KIND else side + b"/" + kind.encode()


def _hex_bytes(message: dict[str, Any], key: str, size: int) -> bytes:
    value = message.get(key)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise AuthError(f"handshake field {key!r} is missing or malformed")
    return raw


def server_handshake(stream: Stream, token: bytes, server_info: dict[str, Any] | None = None, *,
                     kind: str = _SERVER_KIND) -> None:
    """Authenticate a new connection on the server side; raise AuthError (after telling the peer) if it fails."""
    server_nonce = os.urandom(NONCE_BYTES)
    send_frame(stream, {"distrun": kind, "protocol": PROTOCOL_VERSION, "nonce": server_nonce.hex()})
    hello = recv_frame(stream, MAX_AUTH_FRAME_BYTES)
    if hello.get("protocol") != PROTOCOL_VERSION:
        send_frame(stream, {"ok": False, "error": f"this server speaks protocol {PROTOCOL_VERSION}"})
        raise AuthError(f"client speaks protocol {hello.get('protocol')!r}, not {PROTOCOL_VERSION}")
    try:
        client_nonce = _hex_bytes(hello, "nonce", NONCE_BYTES)
        client_mac = _hex_bytes(hello, "mac", hashlib.sha256().digest_size)
    except AuthError:
        send_frame(stream, {"ok": False, "error": "authentication failed"})
        raise
    expected = mac(token, _label(b"client", kind), server_nonce, client_nonce)
    if not hmac.compare_digest(client_mac, expected):
        send_frame(stream, {"ok": False, "error": "authentication failed"})
        raise AuthError("wrong token")
    send_frame(stream, {"ok": True, "mac": mac(token, _label(b"server", kind), client_nonce, server_nonce).hex(),
                        "server": server_info or {}})


def client_handshake(stream: Stream, token: bytes, *, kind: str = _SERVER_KIND) -> dict[str, Any]:
    """Prove the token to the server and check its proof in return; return the server's info."""
    greeting = recv_frame(stream, MAX_AUTH_FRAME_BYTES)
    if greeting.get("distrun") != kind:
        raise AuthError(f"the port does not answer as a distrun {kind}")
    if greeting.get("protocol") != PROTOCOL_VERSION:
        raise AuthError(f"the server speaks protocol {greeting.get('protocol')!r}, this client {PROTOCOL_VERSION}")
    server_nonce = _hex_bytes(greeting, "nonce", NONCE_BYTES)
    client_nonce = os.urandom(NONCE_BYTES)
    send_frame(stream, {"protocol": PROTOCOL_VERSION, "nonce": client_nonce.hex(),
                        "mac": mac(token, _label(b"client", kind), server_nonce, client_nonce).hex()})
    answer = recv_frame(stream)
    if not answer.get("ok"):
        raise AuthError(f"the server refused the connection: {answer.get('error', 'no reason given')}")
    server_mac = _hex_bytes(answer, "mac", hashlib.sha256().digest_size)
    if not hmac.compare_digest(server_mac, mac(token, _label(b"server", kind), client_nonce, server_nonce)):
        raise AuthError("the server could not prove it holds the token")
    info = answer.get("server")
    return info if isinstance(info, dict) else {}
