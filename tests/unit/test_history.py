"""The history `distrun down` keeps on the client (``client/history``) and the dashboard's view of a
cluster that is down (``dashboard/_kept``), on job folders the server's own ``JobRecord`` writes:
copied through a real ``python -m distrun.server history`` (this machine as the host), listed,
replayed into the same rows, charts and logs a live job's page has, and never copied twice."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from distrun.client import history
from distrun.client.history import history_dir, keep_host_history, kept_clusters, note_kept
from distrun.dashboard import KeptSource
from distrun.errors import HostError, UsageError
from distrun.links import LocalConnection
from distrun.protocol import Done, Output, Started, Step
from distrun.server._job_record import JobRecord

RECIPE = "clicks.py"


def _job(jobs_dir: Path, job_id: str, rank: int, start: float, *, state: str = "succeeded") -> None:
    """One host's record of a 2-rank job (``rank`` runs here), written as a server writes it."""
    record = JobRecord(job_id, jobs_dir / job_id, started_at=start,
                       meta={"recipe": RECIPE, "strategy": "multi-worker", "world_size": 2, "ranks": [rank, rank],
                             "layout": "dp 2"})
    record.folder.mkdir(parents=True)
    record.record(Started(rank=rank, time=start + 0.1, pid=100 + rank, device="cpu", world_size=2, recipe_kind="fit"))
    record.record(Output(rank=rank, time=start + 0.2 + rank / 100, stream="stdout", line=f"hello from rank {rank}"))
    for step in (1, 2, 3):
        record.record(Step(rank=rank, time=start + step, step=step, epoch=0, loss=1.0 / step, samples_per_s=50.0,
                           mem_mb=120.0, total_steps=3))
    record.record(Done(rank=rank, time=start + 3.5, steps=3, final_loss=1 / 3, samples_per_s=50.0, first_step_time=None))
    record.finish(state, {"state": state})


def _host(root: Path, name: str, rank: int, jobs: list[tuple[str, float]]) -> str:
    """A host's server folder holding ``jobs`` (id, start), its rank of each; the folder's path."""
    state_dir = root / name
    for job_id, start in jobs:
        _job(state_dir / "jobs", job_id, rank, start)
    (state_dir / "jobs" / "still-running").mkdir(parents=True)  # no result.json: not finished, not kept
    return str(state_dir)


def test_down_keeps_each_hosts_finished_jobs_once_and_the_dashboard_replays_them(tmp_path: Path) -> None:
    start = time.time() - 100
    hosts = {"10.0.0.1": _host(tmp_path / "hosts", "h1", 0, [("job-a", start), ("job-b", start + 10)]),
             "10.0.0.2": _host(tmp_path / "hosts", "h2", 1, [("job-a", start), ("job-b", start + 10)])}
    home, cluster_file = tmp_path / "home", tmp_path / "lab.yaml"
    cluster_file.write_text("name: lab\n")
    folder = history_dir(str(home), cluster_file, "lab")
    remote = LocalConnection()
    kept = {label: keep_host_history(remote, sys.executable, state_dir, label, folder) for label, state_dir in hosts.items()}
    assert kept == {"10.0.0.1": 2, "10.0.0.2": 2}
    assert not kept_clusters(str(home))  # not said whose until `down` notes it
    note_kept(folder, "lab", cluster_file)
    # A second `down` copies nothing again: a finished job's files no longer change.
    assert keep_host_history(remote, sys.executable, hosts["10.0.0.1"], "10.0.0.1", folder) == 0
    (cluster,) = kept_clusters(str(home))
    assert (cluster.name, cluster.file, cluster.hosts) == ("lab", str(cluster_file), ["10.0.0.1", "10.0.0.2"])
    rows = cluster.rows()
    assert [(row.job, row.state, row.hosts, row.layout) for row in rows] == [
        ("job-b", "succeeded", ("10.0.0.1", "10.0.0.2"), "dp 2"), ("job-a", "succeeded", ("10.0.0.1", "10.0.0.2"), "dp 2")]

    source = KeptSource(cluster)
    try:
        listed = source.jobs()
        assert listed["cluster"] == "lab (down)" and [job["job"] for job in listed["jobs"]] == ["job-b", "job-a"]
        watch = source.watch("job-a")
        for _ in range(100):
            if watch.ended:
                break
            time.sleep(0.05)
        update = watch.read(None)
        assert update is not None and update.head["ended"] and update.head["state"] == "succeeded", update
        assert update.head["cluster"] == "lab (down)" and update.head["step"] == 3 and update.head["recipe"] == RECIPE
        assert sorted((row["rank"], row["host"], row["step"]) for row in update.rows or []) == [
            (0, "10.0.0.1", 3), (1, "10.0.0.2", 3)]
        assert [point["step"] for point in update.points] == [1, 2, 3]
        assert [line["line"] for line in update.lines if line["rank"] >= 0] == ["hello from rank 0", "hello from rank 1"]
        assert {line["host"] for line in update.lines if line["rank"] >= 0} == {"10.0.0.1", "10.0.0.2"}
        assert source.lists("job-b") and not source.lists("still-running")
        with pytest.raises(UsageError, match=r"lab is down: job job-a ended with it"):
            source.cancel("job-a")
        with pytest.raises(UsageError, match=r"lab is down"):
            source.stacks("job-a")
        assert {(row["host"], row["status"]) for row in source.hosts()["hosts"]} == {("10.0.0.1", "down"), ("10.0.0.2", "down")}
    finally:
        source.close()


def test_a_large_log_stays_on_its_host_and_a_host_that_cannot_list_is_named(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    state_dir = _host(tmp_path / "hosts", "h1", 0, [("job-a", time.time())])
    folder = tmp_path / "kept"
    monkeypatch.setattr(history, "MAX_EVENTS_BYTES", 10)  # every log here is larger
    assert keep_host_history(LocalConnection(), sys.executable, state_dir, "h1", folder) == 1
    copied = folder / "h1" / "job-a"
    assert sorted(path.name for path in copied.iterdir()) == ["job.json", "result.json"]
    assert json.loads((copied / "result.json").read_text()) == {"state": "succeeded"}
    # A host whose distrun has no `history` command (an older one), or no python: one line, naming it.
    with pytest.raises(HostError, match=r"h2: cannot list its past jobs to keep their history"):
        keep_host_history(LocalConnection("h2"), "/nonexistent/python3", state_dir, "h2", folder)


@pytest.mark.parametrize("answer", ['{"jobs": [1]}', '{"jobs": {"a": 1}}', '{"jobs": [{"files": {}}]}',
                                    '{"jobs": [{"job": "..", "files": {"result.json": 2}, "ended_at": 1.0}]}',
                                    '{"jobs": [{"job": "a", "files": {"../../x": 2}, "ended_at": 1.0}]}',
                                    '{"jobs": [{"job": "a", "files": {"result.json": "2"}, "ended_at": 1.0}]}',
                                    "[" * 100_000])
def test_a_host_answer_that_does_not_read_is_one_line_and_writes_nothing(tmp_path: Path, answer: str) -> None:
    """Whatever a host's `history` prints, the client names the host and writes nothing outside the
    history (a job id of ``..`` would name the host's own folder)."""
    liar = tmp_path / "python3"
    (tmp_path / "answer").write_text(answer)
    liar.write_text(f"#!/bin/sh\ncat {tmp_path / 'answer'}\n")
    liar.chmod(0o755)
    folder = tmp_path / "kept"
    with pytest.raises(HostError, match=r"^h1: cannot list its past jobs to keep their history: "):
        keep_host_history(LocalConnection("h1"), str(liar), str(tmp_path), "h1", folder)
    assert not folder.exists()


def test_a_changed_result_is_copied_again_and_a_host_keeps_its_newest_jobs(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    start = time.time() - 100
    state_dir = _host(tmp_path / "hosts", "h1", 0, [("job-a", start), ("job-b", start + 10)])
    folder, remote = tmp_path / "kept", LocalConnection()
    assert keep_host_history(remote, sys.executable, state_dir, "h1", folder) == 2
    result = Path(state_dir) / "jobs" / "job-a" / "result.json"
    result.write_text(json.dumps({"state": "failed"}))  # an --elastic host's ranks rejoined, and ended again
    assert keep_host_history(remote, sys.executable, state_dir, "h1", folder) == 1
    assert json.loads((folder / "h1" / "job-a" / "result.json").read_text()) == {"state": "failed"}
    # Its newest KEPT_JOBS, by when each ended on the host (job-a's result, rewritten, is now the newest).
    monkeypatch.setattr(history, "KEPT_JOBS", 1)
    _job(Path(state_dir) / "jobs", "job-c", 0, start + 20)
    assert keep_host_history(remote, sys.executable, state_dir, "h1", folder) == 1
    assert sorted(path.name for path in (folder / "h1").iterdir()) == ["job-c"]


def test_a_hosts_tar_lands_nowhere_but_its_wanted_jobs_record_files(tmp_path: Path) -> None:
    """The host lists one job, then packs more than it was asked: a path out of the folder, a link,
    another job, a file that is no record's. Only the wanted job's three files land."""
    listing = {"jobs": [{"job": "job-a", "files": {"job.json": 2, "result.json": 2}, "ended_at": 1_700_000_000.0}]}
    liar = tmp_path / "python3"
    liar.write_text(f"""#!{sys.executable}
import io, json, sys, tarfile
if "--pack" not in sys.argv:
    print(json.dumps({listing!r}))
    sys.exit(0)
with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
    def add(name, data=b"{{}}", kind=tarfile.REGTYPE, target=""):
        info = tarfile.TarInfo(name)
        info.size, info.type, info.linkname = (len(data) if kind == tarfile.REGTYPE else 0), kind, target
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    add("../escaped/result.json")
    add("job-a/../../result.json")
    add("job-b/result.json")
    add("job-a/secrets.txt")
    add("job-a/events.ndjson", kind=tarfile.SYMTYPE, target="/etc/passwd")
    add("job-a/job.json")
    add("job-a/result.json", b'{{"state": "succeeded"}}')
""")
    liar.chmod(0o755)
    folder = tmp_path / "history" / "lab"
    assert keep_host_history(LocalConnection("h1"), str(liar), str(tmp_path / "state"), "h1", folder) == 1
    landed = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file())
    assert landed == ["history/lab/h1/job-a/job.json", "history/lab/h1/job-a/result.json",
                      "python3"], landed
    assert (folder / "h1" / "job-a" / "result.json").stat().st_mtime == 1_700_000_000.0
