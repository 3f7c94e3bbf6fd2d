"""A worker server's job table over a long life: finished jobs are forgotten, their logs are not.

Real sockets (each rendezvous binds one); no training processes: the bookkeeping is
what is measured, so a job here is a rendezvous and its cancel, as a client that gave up
would leave it.
"""

from __future__ import annotations

import gc
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from distrun.protocol import Output
from distrun.protocol.secret import new_job_secret
from distrun.protocol.wire import recv_frame, send_frame
from distrun.server import _jobs
from distrun.server._job_record import LISTED_FROM_DISK
from distrun.server._jobs import KEEP_FINISHED, JobError, JobManager


def _short_job(manager: JobManager, job_id: str) -> int:
    port = manager.rendezvous({"job": job_id, "secret": new_job_secret(), "address": "127.0.0.1"})["port"]
    manager.cancel({"job": job_id})
    return port


def test_a_thousand_jobs_leave_the_table_and_the_heap_flat(tmp_path: Path) -> None:
    manager = JobManager(tmp_path)
    for index in range(200):  # warm up: the table fills to KEEP_FINISHED
        _short_job(manager, f"warm{index}")
    tracemalloc.start()
    for index in range(1000):  # and the caches that tracemalloc sees fill (158 KiB, once)
        _short_job(manager, f"fill{index}")
    gc.collect()
    before = tracemalloc.take_snapshot()
    for index in range(1000):
        _short_job(manager, f"job{index}")
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    print(f"heap growth over 1,000 jobs: {grown / 1024:.1f} KiB")
    listed = manager.list({})["jobs"]  # the kept ones, then the newest from disk (their logs unread)
    assert len(listed) == KEEP_FINISHED + LISTED_FROM_DISK
    assert [job["events"] is None for job in listed] == [False] * KEEP_FINISHED + [True] * LISTED_FROM_DISK
    # Measured: +158 KiB over the first 1,000 (caches), then +4 KiB over the next; one job
    # kept whole costs ~7 KiB, so a table that kept every job would grow 7 MiB here.
    assert grown < 64 * 1024, f"the server's heap grew {grown} bytes over 1,000 finished jobs"
    # A forgotten job's log is still on disk, and follow (`distrun logs`) reads it from there.
    frames = list(manager.follow({"job": "job0", "until_now": True}))
    assert frames[-1] == {"result": {"state": "stopped", "failure": None, "reason": "cancelled"}}


def test_a_rendezvous_without_a_submit_closes_after_its_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_jobs, "RENDEZVOUS_LEASE_S", 0.3)
    manager = JobManager(tmp_path)
    port = manager.rendezvous({"job": "orphan", "secret": new_job_secret(), "address": "127.0.0.1"})["port"]
    socket.create_connection(("127.0.0.1", port), timeout=2).close()  # open while the lease runs
    deadline = time.monotonic() + 5
    while manager.list({})["jobs"][0]["state"] != "stopped" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.list({})["jobs"][0]["state"] == "stopped"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with pytest.raises(JobError, match="already submitted"):
        manager.submit({"job": "orphan", "secret": new_job_secret(), "bundle": "0" * 64})


def test_the_rendezvous_binds_the_hosts_address_and_needs_a_secret(tmp_path: Path) -> None:
    manager = JobManager(tmp_path)
    reply = manager.rendezvous({"job": "j1", "secret": new_job_secret(), "address": "127.0.0.1"})
    assert reply["address"] == "127.0.0.1"
    with pytest.raises(JobError, match="job secret"):
        manager.rendezvous({"job": "j2", "secret": "short", "address": "127.0.0.1"})
    with pytest.raises(JobError, match="the secret differs"):
        manager.submit({"job": "j1", "secret": new_job_secret(), "bundle": "0" * 64})



def test_a_failed_submit_leaves_the_lease_running_and_a_forgotten_id_is_not_reused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_jobs, "RENDEZVOUS_LEASE_S", 0.3)
    manager = JobManager(tmp_path)
    secret = new_job_secret()
    port = manager.rendezvous({"job": "j", "secret": secret, "address": "127.0.0.1"})["port"]
    with pytest.raises(JobError, match="was not uploaded"):  # the client then goes away
        manager.submit({"job": "j", "secret": secret, "bundle": "0" * 64})
    deadline = time.monotonic() + 5
    while manager.list({})["jobs"][0]["state"] != "stopped" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.list({})["jobs"][0]["state"] == "stopped"  # the lease still closed it
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    for index in range(_jobs.KEEP_FINISHED + 1):  # "j" is forgotten, its log is on disk
        _short_job(manager, f"other{index}")
    assert "j" not in {job["job"] for job in manager.list({})["jobs"] if job["events"] is not None}  # not kept
    assert {job["job"]: job["state"] for job in manager.list({})["jobs"]}["j"] == "stopped"  # listed from disk
    with pytest.raises(JobError, match="exists"):
        manager.rendezvous({"job": "j", "secret": new_job_secret(), "address": "127.0.0.1"})


def test_a_job_told_to_stop_before_its_submit_is_never_started(tmp_path: Path) -> None:
    """Ctrl-C right after the rendezvous: the stop is on the record, the submit is refused, the cancel ends it."""
    manager = JobManager(tmp_path)
    secret = new_job_secret()
    port = manager.rendezvous({"job": "j", "secret": secret, "address": "127.0.0.1"})["port"]
    manager.stopping({"job": "j", "reason": "interrupted by alice from laptop"})
    with pytest.raises(JobError, match=r"is stopping \(interrupted by alice from laptop\)"):
        manager.submit({"job": "j", "secret": secret, "bundle": "0" * 64})
    manager.cancel({"job": "j", "reason": "interrupted by alice from laptop"})
    listed = manager.list({})["jobs"][0]
    assert (listed["state"], listed["reason"]) == ("stopped", "interrupted by alice from laptop")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_local_jobs_bad_arguments_are_refused_before_a_record_exists(tmp_path: Path) -> None:
    """`local_job` (a local `distrun train` listing its job): a malformed size is one error frame,
    and no record is left pending in `distrun jobs`."""
    manager = JobManager(tmp_path)
    server_end, client_end = socket.socketpair()
    with server_end, client_end:
        manager.local_job(server_end, {"id": 7, "op": "local_job", "args": {"job": "local-x", "world_size": "abc"}})
        reply = recv_frame(client_end)
    assert reply["ok"] is False and reply["id"] == 7
    assert reply["error"]["message"] == "world_size: expected a whole number. Received: 'abc'"
    assert manager.list({})["jobs"] == []


def test_a_local_jobs_record_ends_lost_when_its_client_goes(tmp_path: Path) -> None:
    """The connection is the lease: closed without a result, the record reads lost, with why."""
    manager = JobManager(tmp_path)
    server_end, client_end = socket.socketpair()
    serving = threading.Thread(target=manager.local_job, args=(server_end, {
        "id": 1, "op": "local_job", "args": {"job": "local-y", "world_size": 2, "recipe": "r.py",
                                             "strategy": "mirrored", "pid": 123}}))
    serving.start()
    assert recv_frame(client_end)["ok"] is True
    line = Output(rank=0, time=1.0, stream="stdout", line="hello")
    send_frame(client_end, {"event": {"type": "output", **line.__dict__}})
    deadline = time.monotonic() + 5
    while manager.list({})["jobs"][0]["events"] < 1:
        assert time.monotonic() < deadline, "the event was not recorded"
        time.sleep(0.01)
    client_end.close()
    serving.join(5)
    server_end.close()
    (row,) = manager.list({})["jobs"]
    assert (row["job"], row["state"], row["recipe"], row["world_size"]) == ("local-y", "lost", "r.py", 2)
    assert "ended without a result" in row["error"]


def test_an_ended_record_set_aside_leaves_room_for_a_rejoining_record(tmp_path: Path) -> None:
    """--elastic: a host whose ranks ended (a link down past the lease) rejoins in a new record of the
    same job; the ended one's files move aside, numbered, so the new one's result.json is its own."""
    from distrun.server._job_record import JobRecord

    for number in (1, 2):
        record = JobRecord("j", tmp_path)
        record.record_note("ran")
        record.finish("stopped", {"state": "stopped", "run": number})
        record.set_aside()
        assert not (tmp_path / "result.json").exists() and not (tmp_path / "events.ndjson").exists()
        assert f'"run": {number}' in (tmp_path / f"result.{number}.json").read_text()
        assert "ran" in (tmp_path / f"events.{number}.ndjson").read_text()
