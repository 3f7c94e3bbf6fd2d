"""Another user of the machine cannot reach a local job's store (issue 33, item 2).

torch's TCPStore and gloo's pairs listen on loopback and authenticate nobody. A local job's
processes now share a network namespace of their own (``launch/_netns``): the store's port is
open inside it and closed to every process outside, whatever its user. The control run
(``DISTRUN_NETWORK=host``) shows the exposure is real: there another uid connects.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, assert_no_processes

#: A plain script: every rank says its store port and its network namespace, then waits for the
#: test's word (a file) before its last collective.
WAITS = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
print("NET", os.environ["MASTER_PORT"], os.stat("/proc/self/ns/net").st_ino, flush=True)
go = sys.argv[1]
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)
dist.barrier()
"""

OTHER_UID = 4242  # no account needed: the test runs as root and a forked child takes this uid


def _connects_as(uid: int, port: int) -> bool:
    """Whether a process of ``uid`` in this (the machine's) network reaches 127.0.0.1:``port``."""
    "127.0.0.1".encode("idna")  # the codec loaded now: the child, once another uid, cannot read it
    pid = os.fork()
    if pid == 0:  # the child: socket calls and _exit only
        code = 2
        try:
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket() as probe:
                probe.settimeout(2)
                probe.connect(("127.0.0.1", port))
                code = 0
        except OSError:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) in (0, 1), "the probe could not take another uid"
    return os.WEXITSTATUS(status) == 0


def _run_and_probe(tmp_path: Path, env: dict[str, str]) -> tuple[bool, set[int], str]:
    tmp_path.mkdir()
    recipe = tmp_path / "waits.py"
    recipe.write_text(WAITS)
    go = tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-m", "distrun", "train", str(recipe), "-s", "mirrored", "--replicas",
                             "2", "--json", "--", str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, **env})
    assert proc.stdout is not None
    ports, namespaces, said = set(), set(), []
    try:
        for line in proc.stdout:
            event = json.loads(line) if line.startswith("{") else {}
            said.append(event.get("line", ""))
            if event.get("type") == "output" and event["line"].startswith("NET "):
                _, port, inode = event["line"].split()
                ports.add(int(port))
                namespaces.add(int(inode))
                if sum(1 for text in said if text.startswith("NET ")) == 2:
                    break
        assert len(ports) == 1, (ports, said[-5:], proc.stderr.read() if proc.poll() is not None else "")
        reached = _connects_as(OTHER_UID, ports.pop())
    finally:
        go.write_text("")
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert_no_processes(str(tmp_path))
    return reached, namespaces, err + "\n".join(said)


def test_another_user_cannot_reach_a_local_jobs_store_but_could_on_the_machines_network(tmp_path: Path) -> None:
    reached, namespaces, _ = _run_and_probe(tmp_path / "private", {})
    ours = os.stat("/proc/self/ns/net").st_ino
    assert len(namespaces) == 1 and ours not in namespaces  # both ranks in one network, not the machine's
    assert not reached
    # The control: on the machine's network (asked for), the other user reaches the store.
    shared, namespaces, _ = _run_and_probe(tmp_path / "host", {"DISTRUN_NETWORK": "host"})
    assert namespaces == {ours} and shared


def test_a_bad_network_choice_is_refused_naming_the_variable(tmp_path: Path) -> None:
    recipe = tmp_path / "waits.py"
    recipe.write_text(WAITS)
    result = subprocess.run([sys.executable, "-m", "distrun", "train", str(recipe), "-s", "mirrored", "--replicas",
                             "2"], capture_output=True, text=True, cwd=REPO, timeout=60,
                            env={**os.environ, "DISTRUN_NETWORK": "none"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == ("error: $DISTRUN_NETWORK: expected private or host. "
                                                      "Received: 'none'")
