"""The parameter-server live view: worker rows (steps/s, staleness) and ps rows (updates/s, traffic, params)."""

from rich.console import Console

from distrun.client._tracker import JobTracker
from distrun.protocol import Heartbeat, PsStats, Started, Step, decode_event, encode_event
from distrun.ui import render_progress


def _render(tracker: JobTracker) -> str:
    console = Console(width=160, record=True, color_system=None)
    console.print(render_progress(tracker.snapshot()))
    return console.export_text()


def _step(rank: int, at: float, step: int, pushes: int, staleness: int) -> Step:
    return Step(rank=rank, time=at, step=step, epoch=0, loss=0.5, samples_per_s=100.0, mem_mb=1.0,
                total_steps=100, pushes=pushes, staleness=staleness)


def test_workers_and_ps_tasks_get_their_own_rows_and_rates():
    tracker = JobTracker("r.py", "parameter-server", replicas=2, started_at=1000.0, ps_tasks=1)
    for rank in range(3):
        tracker.update(Started(rank=rank, time=1000.0, pid=10 + rank, device="cpu", world_size=3, recipe_kind="fit"))
    tracker.update(_step(0, 1001.0, 10, pushes=5, staleness=0))
    tracker.update(_step(0, 1003.0, 30, pushes=25, staleness=3))  # 20 pushes in 2 s
    tracker.update(_step(1, 1001.0, 12, pushes=2, staleness=1))
    tracker.update(PsStats(rank=2, time=1001.0, task=0, updates=10, bytes_in=0, bytes_out=0, params=1234, workers=2))
    tracker.update(PsStats(rank=2, time=1002.0, task=0, updates=40, bytes_in=3 << 20, bytes_out=5 << 20,
                           params=1234, workers=2))
    snapshot = tracker.snapshot()
    assert [r.rank for r in snapshot.workers] == [0, 1] and [r.rank for r in snapshot.ps_tasks] == [2]
    chief = snapshot.workers[0]
    assert chief.steps_per_s == 10.0 and chief.staleness == 3
    ps = snapshot.ps_tasks[0]
    assert ps.updates_per_s == 30.0 and ps.params == 1234 and ps.bytes_out == 5 << 20
    text = _render(tracker)
    assert "steps/s" in text and "staleness" in text and "ps tasks" in text and "updates/s" in text
    row = next(line for line in text.splitlines() if "1,234" in line)
    assert "30.0" in row and "3.0" in row and "5.0" in row  # updates/s, MB in, MB out


def test_a_hang_never_blames_a_ps_task():
    tracker = JobTracker("r.py", "parameter-server", replicas=1, started_at=0.0, ps_tasks=1)
    for rank in range(2):
        tracker.update(Started(rank=rank, time=0.0, pid=1, device="cpu", world_size=2, recipe_kind="fit"))
        # the worker waits in torch; the ps task serves (its main thread in distrun's code)
        tracker.update(Heartbeat(rank=rank, time=0.0, where="distrun" if rank else "torch"))
    hang = tracker.check_hang(timeout_s=0.0, heartbeat_s=1e9)
    assert hang is not None and hang.rank == -1 and hang.waiting == (0,)


def test_ps_events_round_trip_through_json():
    event = PsStats(rank=3, time=1.0, task=1, updates=7, bytes_in=8, bytes_out=9, params=10, workers=2)
    assert decode_event(encode_event(event)) == event
