"""A server's history from disk (issue 50): which finished job folders `jobs` lists beside the jobs it
keeps in memory, in what order, and what it reads to list them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from distrun.server._job_record import past_jobs


def _job(jobs: Path, name: str, ended_at: float, *, started_at: float | None, state: str = "succeeded") -> None:
    folder = jobs / name
    folder.mkdir(parents=True)
    if started_at is not None:
        (folder / "job.json").write_text(json.dumps({"started_at": started_at,
                                                     "meta": {"recipe": f"{name}.py", "strategy": "mirrored"}}))
    (folder / "result.json").write_text(json.dumps({"state": state}))
    os.utime(folder / "result.json", (ended_at, ended_at))
    (folder / "events.ndjson").write_bytes(b"not read by a listing\n")


def test_the_newest_finished_jobs_with_their_start_and_meta_none_kept_none_without_job_json(tmp_path):
    jobs = tmp_path / "jobs"
    _job(jobs, "old", 1_000.0, started_at=900.0)
    _job(jobs, "new", 3_000.0, started_at=2_900.0, state="failed")
    _job(jobs, "kept", 4_000.0, started_at=3_900.0)  # in memory: listed from there, not twice
    _job(jobs, "before-upgrade", 5_000.0, started_at=None)  # an older server's folder: no job.json
    (jobs / "running").mkdir()  # no result.json yet
    (jobs / "running" / "job.json").write_text("{}")
    listed = past_jobs(jobs, kept={"kept"})
    assert [(row["job"], row["state"], row["started_at"], row["recipe"]) for row in listed] == [
        ("new", "failed", 2_900.0, "new.py"), ("old", "succeeded", 900.0, "old.py")]
    assert all(row["events"] is None for row in listed)  # no log was read
    assert [row["job"] for row in past_jobs(jobs, kept=set(), limit=1)] == ["kept"]  # the newest by its end
    assert past_jobs(tmp_path / "absent", kept=set()) == []
