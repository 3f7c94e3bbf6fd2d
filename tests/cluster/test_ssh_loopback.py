"""`distrun up / status / down` through a real OpenSSH server on a loopback port."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from distrun.config import parse_cluster
from distrun.links import Connection
from tests._sshd import Sshd, fingerprint, keygen
from tests.cluster.conftest import Loopback, distrun_processes, kill_all
from tests.conftest import REPO, run_cli


def _alive(pid: int) -> bool:
    """Running, not a zombie: a stopped server's parent (init here) may reap it late."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _report(result) -> dict:
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON report: {result.stdout[-1500:]} {result.stderr[-1500:]}"
    return json.loads(lines[-1])


def test_up_status_down_through_sshd(loopback: Loopback) -> None:
    cluster = loopback.write_cluster()
    up = run_cli("up", str(cluster), "--json", timeout=60)
    assert up.returncode == 0, up.stderr
    report = _report(up)
    (row,) = report["hosts"]
    assert row["status"] == "started" and row["host"] == f"127.0.0.1:{loopback.sshd.port}"
    server = row["server"]
    assert server["version"] == "0.1.0" and server["cpu_count"] == os.cpu_count()
    assert row["slots"] == 1  # no GPU here: one slot
    # Per-host state lives under workdir/<cluster name>/<address>_<port>, private to the user.
    state_dir = loopback.workdir / "test" / f"127.0.0.1_{loopback.sshd.port}"
    assert server["state_dir"] == str(state_dir)
    assert (state_dir / "server.json").stat().st_mode & 0o777 == 0o600
    assert state_dir.stat().st_mode & 0o777 == 0o700
    proc = psutil.Process(server["pid"])
    # Detached from the SSH session: its own session, and it outlived the command that started it.
    assert os.getsid(proc.pid) == proc.pid
    # The server listens on the host's loopback only.
    listening = [c for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)

    status = run_cli("status", str(cluster), "--json", timeout=60)
    assert status.returncode == 0, status.stderr
    (row,) = _report(status)["hosts"]
    assert row["status"] == "up" and row["server"]["pid"] == server["pid"] and row["rtt_ms"] > 0

    table = run_cli("status", str(cluster), timeout=60)
    assert table.returncode == 0 and f"127.0.0.1:{loopback.sshd.port}" in table.stdout and "up" in table.stdout

    down = run_cli("down", str(cluster), "--json", timeout=60)
    assert down.returncode == 0, down.stderr
    (row,) = _report(down)["hosts"]
    assert row["status"] == "stopped" and row["processes_left"] == 0
    assert not _alive(server["pid"])
    assert distrun_processes(loopback.root) == []
    assert not (state_dir / "server.json").exists()

    after = run_cli("status", str(cluster), "--json", timeout=60)
    assert after.returncode == 6 and _report(after)["hosts"][0]["status"] == "not running"


def test_up_is_idempotent_and_replaces_dead_or_stale_servers(loopback: Loopback) -> None:
    cluster = loopback.write_cluster()
    first = _report(run_cli("up", str(cluster), "--json", timeout=60))["hosts"][0]
    second = _report(run_cli("up", str(cluster), "--json", timeout=60))["hosts"][0]
    assert second["status"] == "up" and second["server"]["pid"] == first["server"]["pid"]

    os.kill(first["server"]["pid"], signal.SIGKILL)  # a crashed server leaves its state file behind
    dead = run_cli("status", str(cluster), "--json", timeout=60)
    assert dead.returncode == 6 and "does not answer" in _report(dead)["hosts"][0]["message"]
    third = _report(run_cli("up", str(cluster), "--json", timeout=60))["hosts"][0]
    assert third["status"] == "restarted" and third["server"]["pid"] != first["server"]["pid"]

    # A changed env in the cluster file makes the running server stale: `up` replaces it.
    cluster = loopback.write_cluster(extra="env: {DISTRUN_TEST_X: changed}".replace("DISTRUN_TEST_X", "TEST_X"))
    fourth = _report(run_cli("up", str(cluster), "--json", timeout=60))["hosts"][0]
    assert fourth["status"] == "restarted" and fourth["server"]["pid"] != third["server"]["pid"]
    assert not _alive(third["server"]["pid"])
    left = distrun_processes(loopback.root)
    servers = [proc for proc in left if "distrun.server" in " ".join(proc.cmdline())]
    assert [proc.pid for proc in servers] == [fourth["server"]["pid"]]
    # Besides it, only its own warm interpreter: the old servers' zygotes died with them.
    assert all(proc.ppid() == fourth["server"]["pid"] for proc in left if proc not in servers)


def test_hostile_values_pass_through_literally(loopback: Loopback, tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    workdir = tmp_path / "work $(touch CANARY); echo x `touch CANARY`".replace("CANARY", str(canary))
    value = f"line1\n$(touch {canary})\n'; touch {canary}; '"
    cluster = loopback.write_cluster(workdir=workdir, extra=f"env:\n  HOSTILE: {json.dumps(value)}")
    up = run_cli("up", str(cluster), "--json", timeout=60)
    assert up.returncode == 0, up.stderr
    server = _report(up)["hosts"][0]["server"]
    assert server["state_dir"].startswith(str(workdir))  # the folder has the literal name
    assert psutil.Process(server["pid"]).environ()["HOSTILE"] == value
    assert not canary.exists()
    assert run_cli("down", str(cluster), timeout=60).returncode == 0
    assert not canary.exists()


@pytest.mark.parametrize("address", ["h1;touch /tmp/distrun-x", "-oProxyCommand=touch /tmp/distrun-x",
                                     "$(touch /tmp/distrun-x)", "h1\nh2"])
def test_hostile_addresses_are_rejected_before_any_connection(loopback: Loopback, address: str) -> None:
    cluster = loopback.write_cluster(hosts=[loopback.host(address=json.dumps(address))])
    result = run_cli("up", str(cluster), timeout=60)
    assert result.returncode == 2
    assert f"{cluster}:" in result.stderr and "hosts[0].address" in result.stderr
    assert not Path("/tmp/distrun-x").exists()
    assert "Accepted publickey" not in (loopback.sshd.root / "sshd.log").read_text()


def test_unknown_host_key_is_refused_with_its_fingerprint(loopback: Loopback) -> None:
    loopback.keys.known_hosts.write_text("")
    cluster = loopback.write_cluster()
    result = run_cli("up", str(cluster), "--json", timeout=60)
    assert result.returncode == 7
    message = _report(result)["hosts"][0]["message"]
    assert "unknown host key" in message and fingerprint(loopback.sshd.host_pub) in message
    assert "ssh-keyscan" in message and "accept_new_host_keys" in message
    assert distrun_processes(loopback.root) == []

    # Opting in accepts it, records it in known_hosts, and later runs check against it.
    opt_in = loopback.write_cluster(extra="", name="opt-in.yaml").read_text().replace(
        "  connect_timeout_s: 5\n", "  connect_timeout_s: 5\n  accept_new_host_keys: true\n")
    (loopback.root / "opt-in.yaml").write_text(opt_in)
    accepted = run_cli("up", str(loopback.root / "opt-in.yaml"), "--json", timeout=60)
    assert accepted.returncode == 0, accepted.stderr
    assert f"[127.0.0.1]:{loopback.sshd.port} ssh-ed25519" in loopback.keys.known_hosts.read_text()
    assert run_cli("status", str(cluster), timeout=60).returncode == 0


def test_changed_host_key_is_refused(loopback: Loopback, tmp_path: Path) -> None:
    other = tmp_path / "other_host_key"
    keygen(other)
    key_type, key = Path(f"{other}.pub").read_text().split()[:2]
    loopback.keys.known_hosts.write_text(f"[127.0.0.1]:{loopback.sshd.port} {key_type} {key}\n")
    result = run_cli("status", str(loopback.write_cluster()), "--json", timeout=60)
    assert result.returncode == 7
    message = _report(result)["hosts"][0]["message"]
    assert "HOST KEY CHANGED" in message
    assert fingerprint(loopback.sshd.host_pub) in message and fingerprint(Path(f"{other}.pub")) in message
    assert "ssh-keygen -R" in message


def test_login_and_interpreter_problems_name_the_host(loopback: Loopback, tmp_path: Path) -> None:
    label = f"127.0.0.1:{loopback.sshd.port}"
    stranger = tmp_path / "stranger"
    keygen(stranger)
    wrong_key = loopback.write_cluster(name="wrong-key.yaml")
    wrong_key.write_text(wrong_key.read_text().replace(str(loopback.keys.identity), str(stranger)))
    result = run_cli("up", str(wrong_key), timeout=60)
    assert result.returncode == 6 and label in result.stdout and "authentication refused" in result.stdout

    missing = loopback.write_cluster(hosts=[loopback.host(python="/nonexistent/bin/python3")], name="nopy.yaml")
    result = run_cli("up", str(missing), timeout=60)
    assert result.returncode == 6 and "'/nonexistent/bin/python3' not found" in result.stdout

    bare = tmp_path / "bare-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    # distrun would come from the client (issue 49), but this bare interpreter has no pip to install
    # it with (pip asked for: uv, where this machine has it, would install it and fail on torch instead).
    no_distrun = loopback.write_cluster(hosts=[loopback.host(python=bare / "bin" / "python")], name="nodr.yaml",
                                        extra="installer: pip\n")
    result = run_cli("up", str(no_distrun), "--json", timeout=60)
    message = _report(result)["hosts"][0]["message"]
    assert result.returncode == 6 and "installing distrun==0.1.0 failed" in message and "has no pip" in message

    old = tmp_path / "old-python"
    old.write_text("#!/bin/sh\necho 3.11.7\necho 0.0.9\n")
    old.chmod(0o755)
    mismatch = loopback.write_cluster(hosts=[loopback.host(python=old)], name="old.yaml")
    result = run_cli("up", str(mismatch), "--json", timeout=60)
    message = _report(result)["hosts"][0]["message"]
    assert result.returncode == 6 and "has distrun 0.0.9" in message and "this client is 0.1.0" in message
    assert distrun_processes(loopback.root) == []


def test_setup_runs_before_the_server_and_its_failure_is_named(loopback: Loopback, tmp_path: Path) -> None:
    marker = tmp_path / "setup ran"
    ok = loopback.write_cluster(extra=f"setup: [{json.dumps(f'echo done >> {json.dumps(str(marker))}')}]")
    assert run_cli("up", str(ok), timeout=60).returncode == 0
    assert marker.read_text() == "done\n"
    assert run_cli("up", str(ok), timeout=60).returncode == 0  # kept: setup is not run again
    assert marker.read_text() == "done\n"
    run_cli("down", str(ok), timeout=60)

    failing = loopback.write_cluster(extra="setup: ['true', 'echo no such package >&2; exit 3']", name="bad.yaml")
    result = run_cli("up", str(failing), "--json", timeout=60)
    message = _report(result)["hosts"][0]["message"]
    assert result.returncode == 6 and "setup[1]" in message and "no such package" in message


def test_unreachable_port_is_reported_by_name_without_hanging(loopback: Loopback) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    cluster = loopback.write_cluster(hosts=[loopback.host(), loopback.host(ssh=f"{{port: {closed}}}", roles="[worker]")])
    result = run_cli("up", str(cluster), "--json", timeout=60)
    assert result.returncode == 6
    rows = {row["host"]: row for row in _report(result)["hosts"]}
    assert rows[f"127.0.0.1:{closed}"]["status"] == "down"
    assert "connection refused" in rows[f"127.0.0.1:{closed}"]["message"]
    assert rows[f"127.0.0.1:{loopback.sshd.port}"]["status"] == "started"  # the other host is unaffected
    run_cli("down", str(cluster), timeout=60)


def test_throttling_sshd_is_retried(loopback: Loopback, make_sshd) -> None:
    sshd = make_sshd(loopback.keys.authorized_keys, extra_config="MaxSessions 2\nMaxStartups 2\n")
    with open(loopback.keys.known_hosts, "a") as handle:
        handle.write(sshd.known_hosts_line())
    cluster = loopback.write_cluster(hosts=[loopback.host(ssh=f"{{port: {sshd.port}}}")], name="throttled.yaml")
    # Two connections that never authenticate fill MaxStartups: sshd drops every new one.
    hogs = [socket.create_connection(("127.0.0.1", sshd.port)) for _ in range(2)]
    threading.Timer(1.5, lambda: [hog.close() for hog in hogs]).start()
    up = run_cli("up", str(cluster), "--json", timeout=90)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "drop connection" in (sshd.root / "sshd.log").read_text()  # sshd really did turn us away

    # MaxSessions 2: six commands at once on one connection; the extra sessions wait their turn.
    spec = parse_cluster(cluster.read_text(), str(cluster)).hosts[0]
    results: list = []
    with Connection(spec) as connection:
        threads = [threading.Thread(target=lambda i=i: results.append(connection.run(["sh", "-c", f"sleep 0.3; echo {i}"])))
                   for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert sorted(int(r.stdout) for r in results) == list(range(6)) and all(r.ok for r in results)
    run_cli("down", str(cluster), timeout=60)


def test_embedded_default_runs_the_same_server_without_ssh(tmp_path: Path) -> None:
    env = {"DISTRUN_HOME": str(tmp_path / "home")}
    up = run_cli("up", "--json", env=env, timeout=60)
    assert up.returncode == 0, up.stderr
    (row,) = _report(up)["hosts"]
    assert row["host"] == "localhost" and row["status"] == "started"
    assert row["server"]["state_dir"] == str(tmp_path / "home" / "local" / "localhost")
    assert run_cli("status", "--json", env=env, timeout=60).returncode == 0
    down = run_cli("down", "--json", env=env, timeout=60)
    assert down.returncode == 0 and _report(down)["hosts"][0]["processes_left"] == 0
    assert distrun_processes(tmp_path) == []
    assert time.time() - row["server"]["started_at"] < 120


def test_the_ssh_agent_is_used_without_an_identity_file(loopback: Loopback, tmp_path: Path) -> None:
    agent_sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(agent_sock)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not agent_sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        env = {"SSH_AUTH_SOCK": str(agent_sock), "HOME": str(tmp_path / "empty-home")}  # no ~/.ssh keys to fall back on
        subprocess.run(["ssh-add", str(loopback.keys.identity)], env={**os.environ, **env}, check=True,
                       capture_output=True)
        cluster = loopback.write_cluster(name="agent.yaml")
        cluster.write_text("\n".join(line for line in cluster.read_text().splitlines()
                                     if "identity_file" not in line) + "\n")
        up = run_cli("up", str(cluster), "--json", env=env, timeout=60)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "Accepted publickey" in (loopback.sshd.root / "sshd.log").read_text()
        without = run_cli("status", str(cluster), "--json", env={**env, "SSH_AUTH_SOCK": str(tmp_path / "none")}, timeout=60)
        assert without.returncode == 6 and _report(without)["hosts"][0]["status"] == "down"
        run_cli("down", str(cluster), env=env, timeout=60)
    finally:
        agent.terminate()
        agent.wait(5)


def test_a_home_relative_workdir_resolves_on_the_host(loopback: Loopback) -> None:
    name = f"distrun-test-{os.getpid()}-{time.monotonic_ns()}"
    cluster = loopback.write_cluster(name="home.yaml")
    cluster.write_text(cluster.read_text().replace(f"workdir: '{loopback.workdir}'", f"workdir: '~/{name}'"))
    workdir = Path(os.path.expanduser("~root")) / name
    try:
        up = run_cli("up", str(cluster), "--json", timeout=60)
        assert up.returncode == 0, up.stdout + up.stderr
        # A quoted ~ is never expanded by a shell: distrun makes it relative to the login directory.
        state_dir = Path(_report(up)["hosts"][0]["server"]["state_dir"])
        assert state_dir == workdir / "test" / f"127.0.0.1_{loopback.sshd.port}"
        assert run_cli("status", str(cluster), timeout=60).returncode == 0
        assert run_cli("down", str(cluster), timeout=60).returncode == 0
    finally:
        kill_all(workdir)
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_host_without_sftp_works_over_exec_channels(loopback: Loopback, tmp_path: Path) -> None:
    """Some hardened sshds have no `Subsystem sftp` line: `distrun up` once failed there with
    `internal error: SSHException: Channel closed.` Files now go over exec channels."""
    sshd = Sshd(tmp_path / "nosftp", sftp=False)
    sshd.start(loopback.keys.authorized_keys)
    try:
        loopback.keys.known_hosts.write_text(loopback.sshd.known_hosts_line() + sshd.known_hosts_line())
        cluster = loopback.write_cluster(hosts=[{"address": "127.0.0.1", "roles": "[chief, worker]",
                                                 "ssh": f"{{port: {sshd.port}}}"}], name="nosftp.yaml")
        up = run_cli("up", str(cluster), "--json", timeout=60)
        assert up.returncode == 0, up.stderr
        recipe = tmp_path / "code" / "linear.py"
        recipe.parent.mkdir()
        recipe.write_text((REPO / "recipes" / "linear.py").read_text())
        trained = run_cli("train", str(recipe), "--cluster", str(cluster), "--json", "--steps", "5",
                          "--checkpoint-dir", "ckpt", "--results-dir", str(tmp_path / "results"), timeout=180)
        assert trained.returncode == 0, trained.stderr[-2000:]
        assert trained.summary["steps"] == 5
        assert list((tmp_path / "results").rglob("*.pt"))  # results came home, read over exec
        down = run_cli("down", str(cluster), "--json", timeout=60)
        assert down.returncode == 0, down.stderr
    finally:
        sshd.stop()
