"""A job's lease on its environment layer (``_env_host._write_lease``, ``_env_collect._leased``).

Hosts that share a workdir (NFS, or this project's namespace lab) lease one layer for one job at
the same moment. They once wrote one file, and a torn lease read as "in use" forever: a CI run kept
a layer no job used. Each host now writes its own lease, whole or not at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from distrun.client._env_collect import LEASES, MARKER, _leased, collect_old
from distrun.client._env_host import _write_lease


def _job_folder(state: Path, host: str, job: str, *, ended: bool) -> str:
    folder = state / host / "jobs" / job
    folder.mkdir(parents=True, exist_ok=True)
    if ended:
        (folder / "result.json").write_text("{}")
    return str(folder)


def test_two_hosts_lease_one_layer_for_one_job_each_in_its_own_file(tmp_path: Path) -> None:
    layer = tmp_path / "envs" / "abc"
    h1 = _job_folder(tmp_path / "state", "h1", "job-1", ended=True)
    h2 = _job_folder(tmp_path / "state", "h2", "job-1", ended=False)
    _write_lease(str(layer / LEASES), "job-1", h1)
    _write_lease(str(layer / LEASES), "job-1", h2)
    leases = sorted((layer / LEASES).iterdir())
    assert [p.name.split(".")[0] for p in leases] == ["job-1", "job-1"]
    assert {json.loads(p.read_text())["folder"] for p in leases} == {h1, h2}
    assert _leased(str(layer))  # h2's ranks have not ended
    (Path(h2) / "result.json").write_text("{}")
    assert not _leased(str(layer))


#: A host writing its lease again and again: a fresh interpreter each (a forked copy of this
#: threaded pytest process can inherit a lock held at the fork and hang, as one unit run did).
_HAMMER = """
import os, sys, time
from distrun.client._env_host import _write_lease
while not os.path.exists(sys.argv[3]):  # every host imported: all start writing at once
    time.sleep(0.001)
for _ in range(300):
    _write_lease(sys.argv[1], "job-1", sys.argv[2])
"""


def test_leases_written_at_once_by_many_hosts_are_never_torn(tmp_path: Path) -> None:
    folder = tmp_path / LEASES
    dirs = [_job_folder(tmp_path / "state", f"host-{n}" + "x" * n, "job-1", ended=True) for n in range(4)]
    go = tmp_path / "go"
    hosts = [subprocess.Popen([sys.executable, "-c", _HAMMER, str(folder), d, str(go)]) for d in dirs]  # noqa: S603
    try:
        time.sleep(3.0)  # each import takes about 0.7 s here
        go.touch()
        assert [host.wait(timeout=120) for host in hosts] == [0, 0, 0, 0]
    finally:
        for host in hosts:
            host.kill()
    for lease in folder.iterdir():
        assert not lease.name.startswith("."), lease  # nothing staged is left
        json.loads(lease.read_text())  # whole: a torn file raises here
    assert not _leased(str(tmp_path))


def test_a_lease_being_written_or_for_a_job_not_yet_submitted(tmp_path: Path) -> None:
    layer = tmp_path / "abc"
    (layer / LEASES).mkdir(parents=True)
    (layer / LEASES / ".job-1.0123.4567").write_text('{"fol')  # another host's, half written
    assert not _leased(str(layer))
    missing = str(tmp_path / "state" / "h1" / "jobs" / "job-2")  # its server has no folder for it yet
    _write_lease(str(layer / LEASES), "job-2", missing)
    assert _leased(str(layer))
    (lease,) = [p for p in (layer / LEASES).iterdir() if not p.name.startswith(".")]
    lease.write_text(json.dumps({"folder": missing, "at": time.time() - 3600}))  # refused before its submit
    assert not _leased(str(layer))
    lease.write_text("{")  # torn by something else: in use, never removed on a guess
    assert _leased(str(layer))


def _ready(root: Path, name: str, used_at: float) -> str:
    path = root / name
    (path / "bin").mkdir(parents=True)
    (path / MARKER).write_text(json.dumps({"wheels": None}))
    os.utime(path / MARKER, (used_at, used_at))
    return str(path)


def test_a_build_removes_old_layers_but_not_one_a_running_job_leased(tmp_path: Path) -> None:
    root = tmp_path / ".envs"
    now = time.time()
    newest = _ready(root, "new", now)
    leased = _ready(root, "leased", now - 60)
    old = _ready(root, "old", now - 120)
    running = _job_folder(tmp_path / "state", "h1", "job-1", ended=False)
    _write_lease(os.path.join(leased, LEASES), "job-1", running)
    assert collect_old(str(root), 1, newest) == ["old"]
    assert not os.path.exists(old) and os.path.isdir(leased)
    (Path(running) / "result.json").write_text("{}")
    assert collect_old(str(root), 1, newest) == ["leased"]
    assert sorted(os.listdir(root)) == ["leased.lock", "new", "old.lock"]
