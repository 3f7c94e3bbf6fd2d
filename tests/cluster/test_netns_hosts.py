"""Two hosts in Linux network namespaces, each with its own sshd; the client in a third.

The hosts share this machine's filesystem, exactly like hosts that share a home
directory over NFS: per-host state folders must keep them apart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests._sshd import cluster_yaml
from tests.cluster.conftest import Lab, distrun_pids_in, lab_cli


def _cli(lab: Lab, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """`distrun ARGS` in the client namespace, and how long it took."""
    t0 = time.monotonic()
    proc = lab_cli(lab, *args, timeout=90)
    return proc, time.monotonic() - t0


def _report(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1])


def test_two_hosts_up_status_down(lab: Lab) -> None:
    hosts = [{"address": lab.hosts["h1"][1], "roles": "[chief, worker]"},
             {"address": lab.hosts["h2"][1], "roles": "[worker]", "slots": 2}]
    cluster = lab.root / "lab.yaml"
    cluster.write_text(cluster_yaml(lab.keys, hosts, workdir=lab.workdir, name="lab"))

    up, _ = _cli(lab, "up", str(cluster), "--json")
    assert up.returncode == 0, up.stdout + up.stderr
    rows = {row["host"]: row for row in _report(up)["hosts"]}
    h1, h2 = rows[lab.hosts["h1"][1]], rows[lab.hosts["h2"][1]]
    assert h1["status"] == h2["status"] == "started"
    assert h1["roles"] == ["chief", "worker"] and h2["slots"] == 2
    # One filesystem, two hosts: each has its own state folder and its own server.
    assert h1["server"]["state_dir"] != h2["server"]["state_dir"]
    assert h1["server"]["pid"] != h2["server"]["pid"]
    assert lab.netns.pids(lab.hosts["h1"][0]).count(h1["server"]["pid"]) == 1  # it runs inside h1's namespace

    # Loopback only: from the client namespace the server's port is closed on the host's address.
    port = json.loads((lab.workdir / "lab" / lab.hosts["h1"][1] / "server.json").read_text())["port"]
    probe = subprocess.run(["ip", "netns", "exec", lab.client_ns, sys.executable, "-c",
                            "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 3)",
                            lab.hosts["h1"][1], str(port)], capture_output=True, text=True)
    assert probe.returncode != 0 and "refused" in probe.stderr.lower()

    again, _ = _cli(lab, "up", str(cluster), "--json")
    assert [row["status"] for row in _report(again)["hosts"]] == ["up", "up"]

    status, _ = _cli(lab, "status", str(cluster), "--json")
    assert status.returncode == 0
    assert all(row["status"] == "up" and row["rtt_ms"] > 0 for row in _report(status)["hosts"])

    down, _ = _cli(lab, "down", str(cluster), "--json")
    assert down.returncode == 0, down.stdout + down.stderr
    assert [(row["status"], row["processes_left"]) for row in _report(down)["hosts"]] == [("stopped", 0)] * 2
    for ns, _address in lab.hosts.values():
        assert distrun_pids_in(lab, ns) == []


def test_unreachable_host_is_named_within_connect_timeout(lab: Lab) -> None:
    ghost = f"{lab.netns.SUBNET}.99"  # on the bridge's subnet, but no machine answers ARP for it
    hosts = [{"address": lab.hosts["h1"][1], "roles": "[chief, worker]"}, {"address": ghost, "roles": "[worker]"}]
    cluster = lab.root / "ghost.yaml"
    cluster.write_text(cluster_yaml(lab.keys, hosts, workdir=lab.workdir, name="ghost").replace(
        "connect_timeout_s: 5", "connect_timeout_s: 2"))
    up, wall_s = _cli(lab, "up", str(cluster), "--json")
    assert up.returncode == 6
    rows = {row["host"]: row for row in _report(up)["hosts"]}
    assert rows[ghost]["status"] == "down" and "within 2 s" in rows[ghost]["message"]
    assert rows[lab.hosts["h1"][1]]["status"] == "started"
    assert wall_s < 2 + 8, f"up took {wall_s:.1f} s with a 2 s connect timeout"
    assert f"{ghost} (down)" in up.stderr

    status, wall_s = _cli(lab, "status", str(cluster))
    assert status.returncode == 6 and ghost in status.stdout and wall_s < 2 + 8
    # One host cannot be reached: each row says what happened to its own host, and only the
    # unreachable one is "not clean" (h1's row, cleaned, was once listed there too).
    down, _ = _cli(lab, "down", str(cluster), "--json")
    assert down.returncode == 6
    rows = {row["host"]: row for row in _report(down)["hosts"]}
    clean = rows[lab.hosts["h1"][1]]
    assert (clean["status"], clean["processes_left"], clean["exit_code"]) == ("stopped", 0, 0), clean
    assert clean["message"] == "no process of distrun's left"
    # Its own reason: no answer within the timeout, or (ARP given up by then) no route to it.
    assert rows[ghost]["status"] == "down" and rows[ghost]["processes_left"] is None
    assert "within 2 s" in rows[ghost]["message"] or "unreachable" in rows[ghost]["message"], rows[ghost]
    assert f"1 of 2 host(s) not clean: {ghost} (down)" in down.stderr, down.stderr
    assert distrun_pids_in(lab, lab.hosts["h1"][0]) == []
