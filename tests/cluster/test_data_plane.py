"""A stranger on the cluster network, during a parameter-server job and an elastic multi-worker job.

The attacker is a process in its own namespace on the lab's bridge, with torch installed. It
knows the hosts' addresses, scans every port of each for as long as the job runs, and at each open one tries what the
issue's attacker did: torch's store client (get the ps join counter, list the keys, add
itself), and raw bytes. It must read nothing, and each job must end with exactly the
parameters of the same job run without it. While the jobs run, every listening socket on
every host is checked: none binds every interface.

The attacker counts as refused only what a refusal raises (torch's store and network errors,
timeouts, connection errors); anything else is reported and fails the test, so a changed
torch signature cannot pass as "refused". Its control: the same code against a plain,
unguarded TCPStore on a lab host reads that store's keys, in the same test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.cluster.conftest import Lab, brought_up, json_lines, shaped_lab
from tests.conftest import REPO, run_cli
from tests.integration._recipes import ELASTIC

ATTACKER = r'''
import datetime, json, os, socket, sys, time
import torch.distributed as dist

report = {"open": set(), "store_reads": [], "bytes_read": {}, "tries": 0, "unexpected": []}
# What a store that refuses us raises; anything else is the test's failure, not a refusal.
REFUSED = (dist.DistNetworkError, dist.DistStoreError, TimeoutError, ConnectionError)

def unexpected(host, port, what, exc):
    report["unexpected"].append(f"{host}:{port} {what}: {type(exc).__name__}: {exc}"[:300])

def scan(host):
    found = []
    for port in range(1024, 65536):
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex((host, port)) == 0:
                found.append(port)
    return found

def try_store(host, port):
    try:
        store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=1))
    except REFUSED:
        return
    except Exception as exc:
        unexpected(host, port, "TCPStore()", exc)
        return
    for name, attempt in (("list_keys", lambda: store.list_keys()), ("get", lambda: store.get("ps/joins")),
                          ("add", lambda: store.add("ps/joins", 1)),
                          ("get", lambda: store.get("elastic//generation")), ("num_keys", lambda: store.num_keys())):
        try:
            report["store_reads"].append(f"{host}:{port} {attempt()!r}"[:200])
        except REFUSED:
            pass
        except Exception as exc:
            unexpected(host, port, name, exc)

def try_raw(host, port):
    try:
        with socket.create_connection((host, port), timeout=1) as s:
            s.sendall(b"\x00" * 64 + b"GET / HTTP/1.0\r\n\r\n")
            s.settimeout(1)
            data = b""
            try:
                while chunk := s.recv(65536):
                    data += chunk
            except OSError:
                pass
    except OSError:
        return
    if data:
        report["bytes_read"][f"{host}:{port}"] = data[:300].decode("latin-1")

if sys.argv[1] == "--control":  # one store, tried once: the control
    try_store(sys.argv[2], int(sys.argv[3]))
    report["open"] = []
    print(json.dumps(report))
    sys.exit(0)
hosts, until, stop = sys.argv[1].split(","), time.monotonic() + float(sys.argv[2]), sys.argv[3]
while time.monotonic() < until and not os.path.exists(stop):  # the test says stop once the job is over
    for host in hosts:
        for port in scan(host):
            if port == 22:
                continue  # the hosts' sshd: not the job's
            report["open"].add(f"{host}:{port}")
            report["tries"] += 1
            try_store(host, port)
            try_raw(host, port)
report["open"] = sorted(report["open"])
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def data_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, str]]:
    tmp_path = tmp_path_factory.mktemp("data-plane")
    with shaped_lab(tmp_path, ("h1", "h2")) as lab:
        attacker_ns, _address = lab.netns.add_node("x", 30)
        (lab.root / "attacker.py").write_text(ATTACKER)
        yield lab, attacker_ns


def _listeners(ns: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


def _run_attacked(lab: Lab, attacker_ns: str, argv: list[str]) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """Train with the attacker scanning throughout; meanwhile read every host's listening sockets."""
    hosts = ",".join(address for _ns, address in lab.hosts.values())
    stop = lab.root / f"stop-{time.monotonic_ns()}"
    attacker = subprocess.Popen(["ip", "netns", "exec", attacker_ns, sys.executable, str(lab.root / "attacker.py"),
                                 hosts, "120", str(stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=REPO)
    job = subprocess.Popen(["ip", "netns", "exec", lab.client_ns, sys.executable, "-m", "distrun", *argv],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=lab.root)
    seen: dict[str, set[str]] = {name: set() for name in lab.hosts}
    while job.poll() is None:
        for name, (ns, _address) in lab.hosts.items():
            seen[name].update(_listeners(ns))
        time.sleep(0.5)
    out, err = job.communicate()
    stop.touch()
    report_out, report_err = attacker.communicate(timeout=240)
    assert attacker.returncode == 0, report_err[-2000:]
    return (subprocess.CompletedProcess(job.args, job.returncode, out, err), json.loads(report_out.splitlines()[-1]),
            {name: sorted(found) for name, found in seen.items()})


PLAIN_STORE = r'''
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore(sys.argv[1], 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
store.set("ps/joins", "7")
print(store.port, flush=True)
time.sleep(120)
'''


def _control(lab: Lab, attacker_ns: str) -> None:
    """The attacker's own code reads a plain TCPStore on h2 (no secret, no front): what it
    finds nothing in during the job, it would have found."""
    ns, address = lab.hosts["h2"]
    plain = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", PLAIN_STORE, address],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert plain.stdout is not None
        port = plain.stdout.readline().strip()
        assert port.isdigit(), plain.stderr.read() if plain.poll() is not None else port
        done = subprocess.run(["ip", "netns", "exec", attacker_ns, sys.executable, str(lab.root / "attacker.py"),
                               "--control", address, port], capture_output=True, text=True, timeout=60, cwd=REPO)
    finally:
        plain.kill()
        plain.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["unexpected"] == [], report["unexpected"]
    reads = " ".join(report["store_reads"])
    assert "ps/joins" in reads and "b'7'" in reads and " 8" in reads, report["store_reads"]  # listed, read, added


def _check(lab: Lab, run: subprocess.CompletedProcess, report: dict, listeners: dict[str, list[str]]) -> None:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert report["tries"] > 0 and report["open"], "the attacker found the job's ports"
    assert report["unexpected"] == [], report["unexpected"]  # only refusals: nothing else counts as one
    assert report["store_reads"] == [], report["store_reads"]
    for where, data in report["bytes_read"].items():  # a front or probe says who it is and asks for proof, no more
        assert data.startswith("\x00\x00\x00") and '"nonce"' in data and "ps/" not in data, (where, data)
    # Every listener binds loopback or the host's own address: none listens on every interface.
    for name, found in listeners.items():
        address = lab.hosts[name][1]
        for entry in found:
            host = entry.rsplit(":", 1)[0].strip("[]")
            assert host in ("127.0.0.1", address), f"{name} listens on {entry}: {found}"
    rendezvous = [entry for entry in listeners["h1"] if entry.startswith(lab.hosts["h1"][1] + ":")
                  and not entry.endswith(":22")]
    assert rendezvous, f"the store's front on h1's address: {listeners['h1']}"
    # The job's log names the attacker's refused connections, each at most once.
    lines = json_lines(run)
    refused = [line["line"] for line in lines if line.get("type") == "output" and "refused a" in line["line"]]
    assert refused, "the refused connections are named"
    assert len(refused) == len(set(refused)), refused
    assert all("10.199.0.30" in line for line in refused), refused


def _same_parameters(lab: Lab, run: subprocess.CompletedProcess, recipe: Path, folder: Path, *flags: str) -> None:
    """The attacked job's checkpoint (brought home) equals the same job's, run here without the attacker."""
    local = run_cli("train", str(recipe), *flags, "--json", "--checkpoint-dir", str(folder))
    assert local.returncode == 0, local.stderr[-2000:]
    home = lab.root / "distrun-results" / json_lines(run)[0]["job"]
    attacked = torch.load(latest_checkpoint(home), weights_only=True)["model"]
    alone = torch.load(latest_checkpoint(folder), weights_only=True)["model"]
    for key, tensor in alone.items():
        assert torch.equal(attacked[key], tensor), key


def test_a_parameter_server_job_under_attack_ends_with_its_own_parameters(data_lab, tmp_path: Path) -> None:
    lab, attacker_ns = data_lab
    code = tmp_path / "code"
    code.mkdir()
    recipe = code / "embedding.py"
    recipe.write_text((REPO / "recipes" / "embedding.py").read_text())
    roles = {"h1": {"roles": "[chief, worker]", "slots": "1"}, "h2": {"roles": "[ps]"}}
    with brought_up(lab, roles, "psx") as cluster:
        run, report, listeners = _run_attacked(lab, attacker_ns, [
            "train", str(recipe), "--cluster", str(cluster), "--strategy", "ps", "--ps-sync", "--steps", "40",
            "--json", "--checkpoint-dir", str(tmp_path / "ps")])
    _check(lab, run, report, listeners)
    _control(lab, attacker_ns)
    _same_parameters(lab, run, recipe, tmp_path / "one", "--steps", "40")


def test_an_elastic_multi_worker_job_under_attack_ends_with_its_own_parameters(data_lab, tmp_path: Path) -> None:
    lab, attacker_ns = data_lab
    code = tmp_path / "code"
    code.mkdir()
    recipe = code / "elastic.py"
    recipe.write_text(ELASTIC)
    roles = {"h1": {"roles": "[chief, worker]"}, "h2": {"roles": "[worker]"}}
    with brought_up(lab, roles, "elx") as cluster:
        run, report, listeners = _run_attacked(lab, attacker_ns, [
            "train", str(recipe), "--cluster", str(cluster), "--elastic", "1:2", "--steps", "40", "--json",
            "--checkpoint-dir", str(tmp_path / "el"), "--", "--sleep-s", "0.2"])
    _check(lab, run, report, listeners)
    _control(lab, attacker_ns)
    _same_parameters(lab, run, recipe, tmp_path / "two", "--strategy", "mirrored", "--replicas", "2", "--steps", "40")
