"""`bench allreduce`'s link probe counts only a sender that proves the job secret.

Before, the receiver took the first connection that arrived, so anyone on the network
could fake the rate it reported. Real sockets on loopback, the probe's own functions.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from distrun.bench._allreduce_recipe import _receive, _send
from distrun.protocol.wire import AuthError

pytestmark = pytest.mark.integration

SECRET = b"s" * 32


def test_a_stranger_first_is_refused_and_the_real_sender_is_measured(capsys: pytest.CaptureFixture[str]) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(30)
    port = listener.getsockname()[1]
    rate: list[float] = []
    receiver = threading.Thread(target=lambda: rate.append(_receive(listener, SECRET)))
    receiver.start()
    for _ in range(2):  # a stranger streams junk fast, twice: it must count for nothing
        with socket.create_connection(("127.0.0.1", port)) as stranger:
            try:
                stranger.sendall(b"\xff" * (8 << 20))
            except OSError:
                pass
    time.sleep(0.2)
    assert not rate, "the stranger's bytes were measured"
    with pytest.raises(AuthError) as wrong_secret:  # refused as well, and told why
        _send("127.0.0.1", port, 0.1, b"w" * 32)
    assert wrong_secret.type is AuthError
    assert wrong_secret.value.message == "the server refused the connection: authentication failed"
    _send("127.0.0.1", port, 0.3, SECRET)
    receiver.join(timeout=30)
    listener.close()
    assert rate and rate[0] > 0
    said = capsys.readouterr().err
    assert said.count("refused a link-probe connection from 127.0.0.1") == 1, said
