"""The dashboard's timeline (issue 50): which events become a line on a job's page, and their words.

The page's browser tests (tests/integration/test_dashboard.py) see the lines a mirrored job makes;
a diloco job's syncs, a straggler and a changed group are worded here, from the events themselves.
"""

from __future__ import annotations

from distrun.dashboard._timeline import timeline_entry
from distrun.protocol import Heartbeat, MembershipChanged, Output, Step, Straggler, Synced


def test_a_diloco_sync_is_a_line_with_its_bytes_and_wait():
    sync = Synced(rank=0, time=5.0, step=32, outer_step=2, fragment=0, fragments=1, bytes_sent=34_000_000,
                  elements=8_500_000, seconds=0.41, blocked_s=0.12, dtype="bf16")
    entry = timeline_entry(sync, "h1")
    assert entry == {"time": 5.0, "rank": 0, "host": "h1", "kind": "sync",
                     "text": "sync 2 at step 32: 34.0 MB as bf16 in 0.41 s, 0.12 s of it waited"}
    streamed = Synced(rank=0, time=5.0, step=40, outer_step=2, fragment=2, fragments=4, bytes_sent=8_500_000,
                      elements=2_125_000, seconds=0.1, blocked_s=0.0, dtype="fp32")
    assert timeline_entry(streamed, "h1")["text"].startswith("sync 2 at step 40 (fragment 3 of 4): 8.5 MB as fp32")


def test_the_steady_stream_is_left_out_and_changes_are_kept():
    step = Step(rank=0, time=1.0, step=3, epoch=0, loss=0.5, samples_per_s=100.0, mem_mb=300.0)
    assert timeline_entry(step, "h1") is None
    assert timeline_entry(Heartbeat(rank=0, time=1.0, where="collective"), "h1") is None
    assert timeline_entry(Output(rank=0, time=1.0, stream="stdout", line="hi"), "h1") is None
    slow = Straggler(rank=1, time=1.0, host="h2", ratio=1.8, compute_ms=90.0, median_ms=50.0, intervals=3)
    assert timeline_entry(slow, "h2")["text"] == \
        "rank 1 on h2 is slow: 1.80x the others' compute per step (90 ms against 50 ms)"
    group = MembershipChanged(rank=0, time=1.0, generation=2, world_size=2, step=40, left=["rank 1 on h2"],
                              joined=[], recovery_s=1.25)
    assert timeline_entry(group, "h1")["text"] == \
        "group 2: 2 replica(s) from step 40; left: rank 1 on h2 (recovered in 1.2 s)"


def test_a_restarted_jobs_attempts_are_one_row_in_the_newest_first_order():
    from distrun.client.jobs import JobRow
    from distrun.dashboard._source import fold_attempts

    def row(job: str, state: str, started_at: float) -> JobRow:
        return JobRow(job, state, "r.py", "multi-worker", 2, ("h1", "h2"), started_at, False)
    rows = [row("B-r2", "running", 9.0), row("C", "succeeded", 8.0), row("B-r1", "failed", 7.0),
            row("A-r1", "running", 6.0), row("B", "failed", 5.0), row("D-r1", "failed", 4.0)]
    folded = [(first.job, [attempt.job for attempt in attempts]) for first, attempts in fold_attempts(rows)]
    # B's attempts oldest first, at B's place; A-r1 and D-r1 have no A or D listed: each a job of its own.
    assert folded == [("C", ["C"]), ("A-r1", ["A-r1"]), ("B", ["B", "B-r1", "B-r2"]), ("D-r1", ["D-r1"])]


def test_checkpoints_resumes_failures_exits_and_hangs_are_lines_that_say_where():
    from distrun.protocol import Checkpointed, Exited, Failed, Hung, Resumed

    saved = Checkpointed(rank=0, time=1.0, step=40, path="/ck/ckpt-000000040.pt", blocked_ms=12.4)
    assert timeline_entry(saved, "h1")["text"] == "checkpoint at step 40: /ck/ckpt-000000040.pt (training waited 12 ms)"
    resumed = Resumed(rank=0, time=1.0, step=40, path="/ck/ckpt-000000040.pt")
    assert timeline_entry(resumed, "h1")["text"] == "resumed from /ck/ckpt-000000040.pt at step 40"
    failed = timeline_entry(Failed(rank=1, time=2.0, kind="exception", message="ValueError: bad row",
                                   file="/r/rec.py", line=12, step=7), "h2")
    assert failed["kind"] == "error" and failed["host"] == "h2", failed
    assert all(part in failed["text"] for part in ("rank 1", "rec.py:12", "step 7", "ValueError: bad row")), failed
    assert timeline_entry(Exited(rank=1, time=2.0, returncode=-9), "h2")["text"] == "rank 1 exited with -9"
    assert timeline_entry(Exited(rank=1, time=2.0, returncode=0), "h2") is None  # a clean exit is the Done line's
    hung = Hung(rank=0, time=3.0, stalled_s=61.0, where="rank 1 in all_reduce")
    assert timeline_entry(hung, "h1")["text"] == "no rank has stepped for 61 s: rank 1 in all_reduce"
