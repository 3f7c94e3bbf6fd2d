"""Which local jobs get a network of their own (``client/_network``), and the holder that makes one."""

from __future__ import annotations

import os

import pytest

from distrun.client._network import network_choice
from distrun.config import JobSpec
from distrun.errors import ConfigError
from distrun.launch._netns import PrivateNetwork


def _spec(**flat) -> JobSpec:
    return JobSpec.of("/r.py", **flat)


def test_a_job_is_private_unless_its_trackers_may_talk_to_a_server_or_the_host_network_is_asked_for():
    assert network_choice(_spec(), {}) == (True, None)
    assert network_choice(_spec(), {"DISTRUN_NETWORK": "host"}) == (False, None)
    assert network_choice(_spec(extra_env={"DISTRUN_NETWORK": "host"}), {}) == (False, None)  # as the ranks get it
    for local in ("sqlite:////tmp/m.db", "file:///tmp/mlruns", "/tmp/mlruns", "mlruns"):
        assert network_choice(_spec(trackers=("mlflow",), tracker_uris={"mlflow": local}), {}) == (True, None), local
    assert network_choice(_spec(trackers=("mlflow",)), {}) == (True, None)  # MLflow's default: ./mlruns
    for server in ("http://mlflow.lab:5000", "HTTPS://x", "databricks", "postgresql://db/m"):
        private, note = network_choice(_spec(trackers=("mlflow",), tracker_uris={"mlflow": server}), {})
        assert not private and note == (f"note: --tracker mlflow at {server} talks to a server, so the ranks use this "
                                        "machine's network, whose loopback its other users can reach "
                                        "(docs/security.md#co-tenants)"), server
    assert network_choice(_spec(trackers=("mlflow",)), {"MLFLOW_TRACKING_URI": "https://x"})[0] is False
    wandb = _spec(trackers=("wandb",))
    assert network_choice(wandb, {})[0] is False  # it may sync (a key in any of its places): keep the way out
    assert network_choice(wandb, {"WANDB_MODE": "offline"}) == (True, None)


def test_an_interface_named_for_gloo_or_nccl_keeps_the_machines_network():
    assert network_choice(_spec(), {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}) == (True, None)
    private, note = network_choice(_spec(), {"NCCL_SOCKET_IFNAME": "^docker,lo"})
    assert not private and note.startswith("note: $NCCL_SOCKET_IFNAME=^docker,lo names what a job's own network")
    assert network_choice(_spec(extra_env={"GLOO_SOCKET_IFNAME": "eno1"}), {})[0] is False


def test_a_bad_choice_is_refused_naming_the_variable():
    with pytest.raises(ConfigError, match=r"^\$DISTRUN_NETWORK: expected private or host. Received: 'none'$"):
        network_choice(_spec(), {"DISTRUN_NETWORK": "none"})


def test_the_store_socket_of_a_private_network_is_closed_to_the_machine():
    network = PrivateNetwork.open()
    try:
        listener = network.listener()
        port = listener.getsockname()[1]
        assert listener.getsockname()[0] == "127.0.0.1" and port > 0
        inode = os.fstat(network.fds[0]).st_ino
        assert inode != os.stat("/proc/self/ns/net").st_ino
        listener.close()
    finally:
        holder = network.holder_pid
        network.close()
    assert not os.path.exists(f"/proc/{holder}/ns/net")  # the holder ended with the job
