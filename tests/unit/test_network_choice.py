"""Which local jobs get a network of their own (``client/_network``), and the holder that makes one."""

from __future__ import annotations

import os
import socket

import pytest

from distrun.client._network import network_choice
from distrun.config import JobSpec
from distrun.errors import ConfigError
from distrun.launch._netns import PrivateNetwork


def _spec(**flat) -> JobSpec:
    return JobSpec.of("/r.py", **flat)


def test_a_job_is_private_unless_its_trackers_talk_to_a_server_or_the_host_network_is_asked_for():
    assert network_choice(_spec(), {}) == (True, None)
    assert network_choice(_spec(), {"DISTRUN_NETWORK": "host"}) == (False, None)
    files = _spec(trackers=("mlflow",), tracker_uris={"mlflow": "sqlite:////tmp/m.db"})
    assert network_choice(files, {}) == (True, None)
    server = _spec(trackers=("mlflow",), tracker_uris={"mlflow": "http://mlflow.lab:5000"})
    private, note = network_choice(server, {})
    assert not private and note.startswith("note: --tracker mlflow at http://mlflow.lab:5000 talks to a server")
    assert network_choice(_spec(trackers=("mlflow",)), {"MLFLOW_TRACKING_URI": "https://x"})[0] is False
    wandb = _spec(trackers=("wandb",))
    assert network_choice(wandb, {"NETRC": "/nonexistent"}) == (True, None)  # no key: W&B runs offline
    assert network_choice(wandb, {"WANDB_API_KEY": "k"})[0] is False
    assert network_choice(wandb, {"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == (True, None)


def test_a_bad_choice_is_refused_naming_the_variable():
    with pytest.raises(ConfigError, match=r"^\$DISTRUN_NETWORK: expected private or host. Received: 'none'$"):
        network_choice(_spec(), {"DISTRUN_NETWORK": "none"})


def test_the_store_socket_of_a_private_network_is_closed_to_the_machine():
    network = PrivateNetwork.open()
    try:
        listener = network.listener()
        port = listener.getsockname()[1]
        assert listener.getsockname()[0] == "127.0.0.1"
        with socket.socket() as outside, pytest.raises(ConnectionRefusedError):
            outside.connect(("127.0.0.1", port))  # the machine's loopback: nothing listens there
        inode = os.fstat(network.fds[0]).st_ino
        assert inode != os.stat("/proc/self/ns/net").st_ino
        listener.close()
    finally:
        holder = network.holder_pid
        network.close()
    assert not os.path.exists(f"/proc/{holder}/ns/net")  # the holder ended with the job
