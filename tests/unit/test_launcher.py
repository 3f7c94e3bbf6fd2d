"""The launcher with real processes (plain Python children; no torch needed)."""

import json
import os
import sys
import textwrap
import threading
import time

import psutil

from distrun.launch import LocalLauncher, ProcessState, WorkerSpec
from distrun.protocol import Exited, Failed, Output

CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    rank = int(os.environ["RANK"])
    mode = sys.argv[1]
    fd = int(os.environ["DISTRUN_EVENT_FD"])
    if mode == "fail" and rank == 1:
        print("about to fail", flush=True)
        os.write(fd, (json.dumps({"type": "error", "rank": rank, "time": time.time(), "kind": "raised",
                                 "message": "ValueError: boom"}) + "\\n").encode())
        sys.exit(1)
    if mode == "grandchild":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if mode == "ok":
        print(f"hello from {rank} of {os.environ['WORLD_SIZE']} port {os.environ['MASTER_PORT']}", flush=True)
        sys.exit(0)
    time.sleep(600)
    """
)


def launch(mode: str, n: int = 3, grace_s: float = 2.0):
    events = []
    spec = WorkerSpec(argv=(sys.executable, "-c", CHILD, mode), local_world_size=n, stop_grace_s=grace_s)
    launcher = LocalLauncher(spec, events.append)
    return launcher, events


def test_success_relays_output_with_the_torchrun_environment():
    launcher, events = launch("ok")
    result = launcher.run()
    assert result.state is ProcessState.SUCCEEDED
    lines = sorted(e.line for e in events if isinstance(e, Output))
    assert [line.split(" port")[0] for line in lines] == [f"hello from {r} of 3" for r in range(3)]
    assert len({line.split("port ")[1] for line in lines}) == 1  # one rendezvous port


def test_a_failing_rank_stops_the_others_fast_and_is_the_root_cause():
    launcher, events = launch("fail")
    t0 = time.monotonic()
    result = launcher.run()
    assert time.monotonic() - t0 < 10
    assert result.state is ProcessState.FAILED
    assert isinstance(result.failure, Failed) and result.failure.rank == 1
    assert result.failure.message == "ValueError: boom"
    assert sum(isinstance(e, Exited) for e in events) == 3
    assert all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
               for pid in launcher.pids)


def test_stop_kills_whole_process_groups_including_grandchildren():
    launcher, events = launch("grandchild", n=2)
    timer = threading.Timer(1.5, launcher.stop)
    timer.start()
    result = launcher.run()
    assert result.state is ProcessState.STOPPED
    time.sleep(0.2)
    me = psutil.Process(os.getpid())
    sleepers = [p for p in me.children(recursive=True) if "time.sleep(600)" in " ".join(p.cmdline())]
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(600)" in " ".join(p.info["cmdline"] or [])
                 and p.status() != psutil.STATUS_ZOMBIE]
    assert not sleepers and not leftovers


def test_a_killed_rank_is_reported_with_its_signal():
    launcher, events = launch("sleep", n=2)
    def kill_rank0():
        while not launcher.pids:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(launcher.pids[0], 9)

    threading.Thread(target=kill_rank0).start()
    result = launcher.run()
    assert result.state is ProcessState.FAILED
    assert result.failure.rank == 0 and result.failure.message == "killed by SIGKILL"


INDEPENDENT = textwrap.dedent(
    """
    import json, os, sys, time
    rank, marker = int(os.environ["RANK"]), sys.argv[1]
    print("tf", os.environ["TF_CONFIG"], flush=True)
    if rank == 1 and not os.path.exists(marker):  # fails once; a second start lives
        open(marker, "w").close()
        sys.exit(3)
    time.sleep(1.0)
    print(f"rank {rank} finished", flush=True)
    """
)


def _independent(tmp_path, respawns: int):
    events = []
    spec = WorkerSpec(argv=(sys.executable, "-c", INDEPENDENT, str(tmp_path / "failed-once")), local_world_size=3,
                      num_ps=1, independent_ranks=frozenset({1}), respawns=respawns, stop_grace_s=2.0)
    return LocalLauncher(spec, events.append).run(), events


def test_an_independent_rank_fails_alone_and_is_started_again_while_respawns_last(tmp_path):
    result, events = _independent(tmp_path, respawns=1)
    lines = [e.line for e in events if isinstance(e, Output)]
    assert result.state is ProcessState.SUCCEEDED and result.failure is None
    assert "[distrun] rank 1 lost; starting it again (1/1)" in lines
    assert sorted(line for line in lines if line.endswith("finished")) == [f"rank {r} finished" for r in (0, 1, 2)]
    assert [e.returncode for e in events if isinstance(e, Exited) and e.rank == 1] == [3, 0]
    assert result.lost == () and result.record(warm=False, reason=None)["lost_ranks"] == []  # it came back
    tf = [json.loads(line[3:]) for line in lines if line.startswith("tf ")]
    assert {t["task"]["type"] for t in tf} == {"worker", "ps"}
    assert next(t for t in tf if t["task"]["type"] == "ps")["task"]["index"] == 0
    assert len(tf[0]["cluster"]["worker"]) == 2 and len(tf[0]["cluster"]["ps"]) == 1


def test_without_respawns_an_independent_rank_is_lost_and_the_others_finish(tmp_path):
    result, events = _independent(tmp_path, respawns=0)
    lines = [e.line for e in events if isinstance(e, Output)]
    assert result.state is ProcessState.SUCCEEDED
    assert "[distrun] rank 1 lost; the job goes on without it" in lines
    assert result.lost == (1,) and result.record(warm=False, reason=None)["lost_ranks"] == [1]  # named, not just "succeeded"
    assert sorted(line for line in lines if line.endswith("finished")) == ["rank 0 finished", "rank 2 finished"]


def test_torchrun_variables_name_the_run_its_restart_and_the_hosts():
    from distrun.launch._env import rank_env
    from distrun.server._job_args import torchelastic_ids as _torchelastic_ids

    ids = _torchelastic_ids("20261123-014911-218bdc-r2", 3)
    assert ids == {"run_id": "20261123-014911-218bdc", "restart_count": 2, "max_restarts": 3}
    assert _torchelastic_ids("20261123-014911-218bdc", 0)["restart_count"] == 0
    spec = WorkerSpec(argv=("python",), local_world_size=2, world_size=6, rank_offset=2, node_rank=1,
                      rank_hosts=("10.0.0.1",) * 2 + ("10.0.0.2",) * 2 + ("10.0.0.3",) * 2, **ids)
    env = rank_env(spec, local_rank=1, master_port=29500)
    assert (env["RANK"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("3", "1", "3")
    assert (env["TORCHELASTIC_RUN_ID"], env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == (
        "20261123-014911-218bdc", "2", "3")
