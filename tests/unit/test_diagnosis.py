"""The stacks report and the Flight Recorder summary, from what hosts answer (py-spy's and torch's JSON)."""

from __future__ import annotations

import json

from rich.console import Console

from distrun.client._diagnosis import awaited_and_missing, build_diagnosis, read_record
from distrun.launch._pyspy import StackUnavailable, is_user_file, main_thread_frames
from distrun.protocol import decode_event, encode_event
from distrun.protocol.diagnosis import CollectiveRecord, Frame, RankStack
from distrun.ui.diagnosis import collapse_stacks, headline, render_diagnosis

WAITING = (Frame("all_reduce", "torch/distributed/distributed_c10d.py", 3252),
           Frame("train_step", "/home/me/recipe.py", 42, user=True), Frame("<module>", "/home/me/recipe.py", 50, True))
SLEEPING = (Frame("DataLoader.__next__", "torch/utils/data/dataloader.py", 700),
            Frame("train_step", "/home/me/recipe.py", 40, user=True))


def _stack(rank: int, frames: tuple[Frame, ...] = WAITING, host: str = "h1") -> RankStack:
    return RankStack(rank=rank, host=host, pid=100 + rank, frames=frames)


def test_ranks_at_the_same_frames_collapse_and_the_odd_one_stands_alone() -> None:
    stacks = [_stack(r) for r in range(16) if r != 7] + [_stack(7, SLEEPING, host="h2")]
    groups = collapse_stacks(stacks)
    assert [ranks for ranks, _ in groups] == [tuple(r for r in range(16) if r != 7), (7,)]
    assert headline(groups[0][1].frames) == "all_reduce ← train_step (recipe.py:42)"
    assert headline(groups[1][1].frames) == "DataLoader.__next__ ← train_step (recipe.py:40)"
    text = _text(build_diagnosis("asked", stacks, {}, None))
    assert "ranks 0-6,8-15: all_reduce ← train_step (recipe.py:42)" in text
    assert "rank 7 (h2): DataLoader.__next__ ← train_step (recipe.py:40)" in text


def test_a_line_apart_is_a_different_stack_and_errors_group_by_reason() -> None:
    moved = (WAITING[0], Frame("train_step", "/home/me/recipe.py", 43, user=True), WAITING[2])
    failed = [RankStack(rank=r, host="h2", pid=9 + r, error="py-spy: Permission denied") for r in (3, 4)]
    groups = collapse_stacks([_stack(0), _stack(1, moved), *failed])
    assert sorted(ranks for ranks, _ in groups) == [(0,), (1,), (3, 4)]
    assert "ranks 3-4: no stack: py-spy: Permission denied" in _text(build_diagnosis("asked", failed, {}, None))


def test_the_headline_falls_back_to_distruns_loop_then_to_the_leaf() -> None:
    backward = (Frame("_engine_run_backward", "torch/autograd/graph.py", 979),
                Frame("fit.<locals>.train_step", "distrun/runtime/_fit.py", 102))
    assert headline(backward) == "_engine_run_backward ← fit.<locals>.train_step (_fit.py:102)"
    assert headline(backward[:1]) == "_engine_run_backward (graph.py:979)"
    assert headline((Frame("pthread_cond_wait", "libc.so.6", 0),)) == "pthread_cond_wait"


def _record(rank: int, seq: int, completed: bool, group: str = "0") -> CollectiveRecord:
    return CollectiveRecord(rank=rank, host="h", group=group, seq=seq, op="gloo:all_reduce", completed=completed)


def test_ranks_behind_the_awaited_collective_are_named() -> None:
    records = [_record(0, 10, False), _record(1, 9, True), _record(2, 10, False), _record(3, 10, False)]
    assert awaited_and_missing(records) == ("#10 gloo:all_reduce", (1,))
    assert awaited_and_missing([_record(0, 4, True), _record(1, 4, True)]) == (None, ())
    assert awaited_and_missing([_record(0, 3, False, "2"), _record(1, 2, True, "2"), _record(2, 1, True, "0")]) == (
        "#3 gloo:all_reduce (group 2)", (1,))


def _entry(seq: int, retired: bool, op: str = "gloo:all_reduce", t_ns: int | None = None) -> dict:
    return {"collective_seq_id": seq, "profiling_name": op, "input_sizes": [[1000]], "input_dtypes": ["Float"],
            "retired": retired, "state": "scheduled", "is_p2p": False, "process_group": ["0", "default_pg"],
            "time_created_ns": t_ns if t_ns is not None else seq * 1000}


def test_a_dump_reads_as_its_newest_collective() -> None:
    dump = json.dumps({"version": "2.10", "entries": [_entry(1, True), _entry(2, True, "gloo:broadcast"),
                                                      _entry(3, False)]})
    record = read_record(2, "h2", dump.encode())
    assert (record.seq, record.op, record.sizes, record.completed, record.recorded) == (
        3, "gloo:all_reduce", "[1000] Float", False, 3)
    assert read_record(0, "h", b"not json").error == "its dump is not JSON"
    assert read_record(0, "h", json.dumps({"entries": []})).error == "no collective recorded"
    assert read_record(0, "h", json.dumps({"error": "torch too old"})).error == "torch too old"


def test_a_diagnosis_crosses_json_whole_and_draws_the_table() -> None:
    dumps = {(0, "h1"): json.dumps({"entries": [_entry(5, False)]}).encode(),
             (1, "h2"): json.dumps({"entries": [_entry(4, True)]}).encode(), (2, "h2"): None}
    found = build_diagnosis("hang", [_stack(0), _stack(1, SLEEPING, "h2"), _stack(2, host="h2")], dumps, "/tmp/d")
    assert found.missing == (1,) and found.awaited == "#5 gloo:all_reduce"
    assert decode_event(encode_event(found)) == found
    text = _text(found)
    assert "never entered it: rank 1" in text and "wrote no dump in time" in text and "/tmp/d" in text


def test_py_spy_json_reads_as_the_main_threads_frames() -> None:
    threads = [{"thread_name": "distrun-heartbeat", "frames": [{"name": "sleep", "filename": "/x.py", "line": 1}]},
               {"thread_name": "MainThread", "frames": [
                   {"name": "0x7f43", "filename": "libc.so.6", "short_filename": "libc.so.6", "line": 0},
                   {"name": "all_reduce", "filename": "/usr/lib/python3/site-packages/torch/distributed/c10d.py",
                    "short_filename": "torch/distributed/c10d.py", "line": 3252},
                   {"name": "<module>", "filename": "/work/job/hang.py", "short_filename": "hang.py", "line": 21}]}]
    frames = main_thread_frames(threads)
    assert [(f.function, f.file, f.line, f.user) for f in frames] == [
        ("??", "libc.so.6", 0, False), ("all_reduce", "torch/distributed/c10d.py", 3252, False),
        ("<module>", "hang.py", 21, True)]
    assert not is_user_file("<frozen runpy>") and not is_user_file(json.__file__)
    try:
        main_thread_frames([])
    except StackUnavailable as exc:
        assert "no Python thread" in str(exc)
    else:
        raise AssertionError("an empty dump must not pass for a stack")


def _text(diagnosis) -> str:
    console = Console(width=200, record=True)
    console.print(render_diagnosis(diagnosis))
    return console.export_text()
