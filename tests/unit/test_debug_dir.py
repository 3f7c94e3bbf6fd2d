"""A killed `distrun train` leaves its debug folder; the next local job of the same user removes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from distrun.client._debug_dir import sweep_stale_debug_dirs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _folder(tmp: Path, pid: int, *files: str) -> Path:
    folder = tmp / f"distrun-debug-local-20261125-101010-{pid}-1"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}")
    return folder


def test_a_gone_jobs_empty_folder_or_error_files_are_swept_a_dump_a_live_job_and_others_stay(tmp_path: Path) -> None:
    dead = _dead_pid()
    empty = _folder(tmp_path, dead)
    errors = tmp_path / f"distrun-debug-local-20261125-101011-{dead}-2"
    errors.mkdir()
    (errors / "error-rank1.json").write_text("{}")
    dumped = tmp_path / f"distrun-debug-local-20261125-101012-{dead}-3"
    dumped.mkdir()
    (dumped / "nccl-trace-rank-0").write_text("trace")
    live = tmp_path / f"distrun-debug-local-20261125-101013-{os.getpid()}-4"
    live.mkdir()
    cluster = tmp_path / "distrun-debug-cluster-job"  # not a local job's name: never touched
    cluster.mkdir()
    removed = sweep_stale_debug_dirs(str(tmp_path))
    assert sorted(removed) == sorted([str(empty), str(errors)])
    assert not empty.exists() and not errors.exists()
    assert dumped.exists() and live.exists() and cluster.exists()


def test_another_users_folder_stays(tmp_path: Path) -> None:
    folder = _folder(tmp_path, _dead_pid())
    os.chown(folder, 4242, 4242)  # the tests run as root (the cluster tests need it)
    assert sweep_stale_debug_dirs(str(tmp_path)) == [] and folder.exists()
