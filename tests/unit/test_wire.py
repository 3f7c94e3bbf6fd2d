"""The control-plane wire: framing limits and the mutual HMAC handshake, over real socket pairs."""

from __future__ import annotations

import json
import math
import socket
import struct
import threading

import pytest

from distrun.protocol import Step, decode_event, event_to_dict
from distrun.protocol.cluster import ClusterReport, HostRow, HostStatus, config_digest
from distrun.protocol.wire import (
    MAX_AUTH_FRAME_BYTES,
    AuthError,
    WireError,
    client_handshake,
    recv_frame,
    send_frame,
    server_handshake,
)
from distrun.links import command_line

TOKEN = bytes(range(32))


def handshake(server_token: bytes, client_token: bytes) -> tuple[object, object]:
    a, b = socket.socketpair()
    outcome: dict[str, object] = {}

    def serve() -> None:
        try:
            server_handshake(a, server_token, {"version": "x"})
            outcome["server"] = "ok"
        except Exception as exc:
            outcome["server"] = exc

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        client: object = client_handshake(b, client_token)
    except Exception as exc:
        client = exc
    thread.join(5)
    a.close()
    b.close()
    return outcome["server"], client


def test_both_sides_agree_with_the_same_token() -> None:
    server, client = handshake(TOKEN, TOKEN)
    assert server == "ok" and client == {"version": "x"}


def test_a_wrong_token_fails_on_both_sides() -> None:
    server, client = handshake(TOKEN, bytes(32))
    assert isinstance(server, AuthError) and "wrong token" in str(server)
    assert isinstance(client, AuthError) and "authentication failed" in str(client)


def test_the_client_rejects_a_server_that_cannot_prove_the_token() -> None:
    a, b = socket.socketpair()

    def impostor() -> None:
        send_frame(a, {"distrun": "worker-server", "protocol": 1, "nonce": "00" * 32})
        recv_frame(a)  # the client's proof; an impostor without the token cannot answer it
        send_frame(a, {"ok": True, "mac": "11" * 32})

    thread = threading.Thread(target=impostor)
    thread.start()
    with pytest.raises(AuthError, match="could not prove it holds the token"):
        client_handshake(b, TOKEN)
    thread.join(5)


def test_the_auth_frame_is_length_capped_before_it_is_read() -> None:
    a, b = socket.socketpair()
    b.sendall(struct.pack(">I", MAX_AUTH_FRAME_BYTES + 1))
    with pytest.raises(WireError, match=f"exceeds the {MAX_AUTH_FRAME_BYTES}-byte limit"):
        recv_frame(a, MAX_AUTH_FRAME_BYTES)


@pytest.mark.parametrize("payload, message", [
    (b"\xff\xfe", "not UTF-8 JSON"), (b"[1, 2]", "not a JSON object"), (b"{", "not UTF-8 JSON"),
])
def test_frames_must_be_json_objects(payload: bytes, message: str) -> None:
    a, b = socket.socketpair()
    b.sendall(struct.pack(">I", len(payload)) + payload)
    with pytest.raises(WireError, match=message):
        recv_frame(a)


def test_a_short_read_is_an_error_not_a_hang() -> None:
    a, b = socket.socketpair()
    b.sendall(struct.pack(">I", 10) + b"{}")
    b.close()
    with pytest.raises(WireError, match="closed mid-frame"):
        recv_frame(a)


def test_frames_round_trip_and_never_pickle() -> None:
    a, b = socket.socketpair()
    send_frame(a, {"op": "status", "args": {"n": [1, 2.5, None, "é"]}})
    assert recv_frame(b) == {"op": "status", "args": {"n": [1, 2.5, None, "é"]}}
    with pytest.raises(TypeError):
        send_frame(a, {"object": object()})


def test_a_non_finite_loss_crosses_the_wire() -> None:
    """A `--on-nonfinite warn` step's NaN loss reaches a follower (it used to end the follow)."""
    a, b = socket.socketpair()
    step = Step(rank=0, time=1.0, step=3, epoch=0, loss=float("nan"), samples_per_s=1.0, mem_mb=1.0)
    send_frame(a, {"events": [event_to_dict(step)], "inf": float("inf")})
    got = recv_frame(b)
    assert got["inf"] == math.inf
    back = decode_event(json.dumps(got["events"][0]))
    assert isinstance(back, Step) and math.isnan(back.loss)


def test_remote_commands_are_quoted_element_by_element() -> None:
    line = command_line(["python3", "-c", "print(1)", "/tmp/a b;$(touch x)", "line\nbreak"])
    assert line == "python3 -c 'print(1)' '/tmp/a b;$(touch x)' 'line\nbreak'"


def test_config_digest_is_order_independent() -> None:
    assert config_digest({"env": {"A": "1", "B": "2"}}) == config_digest({"env": {"B": "2", "A": "1"}})
    assert config_digest({"env": {"A": "1"}}) != config_digest({"env": {"A": "2"}})


def test_report_exit_code_puts_a_refused_host_key_first() -> None:
    rows = (HostRow("a", ("worker",), HostStatus.DOWN, exit_code=6), HostRow("b", ("worker",), HostStatus.DOWN, exit_code=7),
            HostRow("c", ("chief",), HostStatus.UP))
    assert ClusterReport("x", "up", rows).exit_code == 7
    assert ClusterReport("x", "up", rows[2:]).exit_code == 0
    stopped = HostRow("a", ("worker",), HostStatus.STOPPED, processes_left=1, exit_code=6)
    assert not ClusterReport("x", "down", (stopped,)).ok
