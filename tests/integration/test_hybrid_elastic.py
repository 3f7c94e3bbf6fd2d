"""`--embeddings ps` with `--elastic`: a lost dense replica heals as under mirrored, and the ps
tasks keep the tables through the loss (they are not restarted).

A real local job through the CLI: two replicas in an elastic gloo group, both tables split over
two ps tasks reached through their own gloo pairs, compared with one-device training of the
same recipe. The kill is placed where a careless round would be applied in part: after the
all-reduce, between one replica's pushes to the two tasks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.conftest import REPO, assert_no_processes, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]

STEPS = 40

#: The recommender recipe, with rank 1 (its first start) SIGKILLed in step ``--die-at``'s push of
#: the tables' rows, between its push to ps task 0 and its push to ps task 1: after DDP's
#: all-reduce, so its peer finishes that step and pushes to both. ``--sleep-s`` slows each
#: replica's step, so the restarted rank (a fresh interpreter) arrives before the job's last step.
RECIPE = (REPO / "recipes" / "recommender.py").read_text() + '''

import os
import signal
import time

_DIE_AT = int(sys.argv[sys.argv.index("--die-at") + 1]) if "--die-at" in sys.argv else 0
_SLEEP_S = float(sys.argv[sys.argv.index("--sleep-s") + 1]) if "--sleep-s" in sys.argv else 0.0
_loss, _pushes = loss, [0]

if os.environ.get("RANK") == "1" and os.environ.get("DISTRUN_INCARNATION", "0") == "0":
    import distrun.strategies.ps.tables as _tables

    _send_row_gradients = _tables.send_row_gradients

    def _die_between_the_tasks(layout, channel, task, touched):
        if task == 1:
            _pushes[0] += 1
            if _pushes[0] == _DIE_AT:
                os.kill(os.getpid(), signal.SIGKILL)
        return _send_row_gradients(layout, channel, task, touched)

    _tables.send_row_gradients = _die_between_the_tasks


def loss(outputs, batch):
    time.sleep(_SLEEP_S)
    return _loss(outputs, batch)
'''


def _train(recipe: Path, *args: str):
    return run_cli("train", str(recipe), "--json", "--device", "cpu", "--steps", str(STEPS), *args)


def test_a_replica_lost_between_two_ps_tasks_pushes_costs_no_half_step(tmp_path: Path) -> None:
    """Both tables split over two ps tasks. Rank 1 dies in step 10 having pushed its rows to ps task
    0 and not to ps task 1: task 0's round is whole, task 1's never can be. Applied where whole
    (task 0) or from rank 0's rows alone (task 1), then again when the step is redone, the tables
    would drift from one-device's and a task would count 41 updates. Instead task 1 drops its
    round, task 0 drops the one it staged on rank 0's word, and the survivor redoes step 10 on the
    whole global batch (its dense part untouched: the push comes before the dense step). Rank 1
    comes back, pulls its rows from the ps tasks (which kept the tables; neither restarted), and
    the job ends with one-device's parameters and Adagrad's sums."""
    recipe = tmp_path / "recommender_faults.py"
    recipe.write_text(RECIPE)
    result = _train(recipe, "--strategy", "mirrored", "--replicas", "2", "--embeddings", "ps", "--ps-tasks", "2",
                    "--ps-partition-mb", "0.001", "--elastic", "1:2", "--checkpoint-dir", str(tmp_path / "hybrid"),
                    "--", "--die-at", "10", "--sleep-s", "0.12")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.json_lines()
    changes = [line for line in lines if line["type"] == "membership"]
    assert [c["world_size"] for c in changes] == [1, 2], changes  # it went on alone, then rank 1 rejoined
    assert changes[0]["left"] == ["rank 1 on 127.0.0.1 (killed by SIGKILL)"] and changes[0]["step"] == 9, changes
    assert [line["returncode"] for line in lines if line["type"] == "exited" and line["rank"] == 1][0] == -9
    for rank in (2, 3):  # the ps tasks: started once, every step applied once (no half round, no step twice)
        assert sum(1 for line in lines if line["type"] == "started" and line["rank"] == rank) == 1
        assert [line for line in lines if line["type"] == "ps" and line["rank"] == rank][-1]["updates"] == STEPS
    summary = result.summary
    assert summary["steps"] == STEPS and summary["steps_lost"] == 0 and summary["restarts"] == 0, summary

    one = _train(recipe, "--strategy", "one-device", "--checkpoint-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    hybrid = torch.load(latest_checkpoint(tmp_path / "hybrid"), weights_only=True)
    reference = torch.load(latest_checkpoint(tmp_path / "one"), weights_only=True)
    assert hybrid["step"] == reference["step"] == STEPS
    assert list(hybrid["model"]) == list(reference["model"])  # the tables gathered back into the plain model
    for key, tensor in reference["model"].items():
        torch.testing.assert_close(hybrid["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    assert sorted(hybrid["optimizer"]["state"]) == sorted(reference["optimizer"]["state"])
    for index, state in reference["optimizer"]["state"].items():  # Adagrad's sums, both tables' from the ps tasks
        for name, value in state.items():
            torch.testing.assert_close(hybrid["optimizer"]["state"][index][name], value, rtol=1e-5, atol=1e-6,
                                       msg=f"{index}.{name}")
    assert_no_processes(str(tmp_path))


def test_a_lost_ps_task_ends_the_job_at_once_named_as_the_cause(tmp_path: Path) -> None:
    """The replicas heal; a ps task holds its rows alone, so its loss ends the job, failed (exit 4), at
    once, in one line that names the ps task: not a replica's reset connection to it, and no hang
    (issue 51). Killed from outside, as the OOM killer or an operator would."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO as repo

    recipe = tmp_path / "recommender_slow.py"
    recipe.write_text(RECIPE)
    proc = subprocess.Popen([sys.executable, "-m", "distrun", "train", str(recipe), "--json", "--device", "cpu",
                             "--steps", "400", "--strategy", "mirrored", "--replicas", "2", "--embeddings", "ps",
                             "--ps-tasks", "1", "--ps-partition-mb", "0.001", "--elastic", "1:2", "--",
                             "--sleep-s", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo)
    assert proc.stdout is not None
    killed_at = None
    ps_pid = None
    try:
        for line in proc.stdout:
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("type") == "started" and event["rank"] == 2:
                ps_pid = event["pid"]
            if event.get("type") == "step" and event["step"] >= 10 and ps_pid and killed_at is None:
                os.kill(ps_pid, signal.SIGKILL)
                killed_at = time.monotonic()
        proc.wait(timeout=60)
        ended_after_s = time.monotonic() - killed_at if killed_at else None
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert killed_at is not None and proc.returncode == 4, (proc.returncode, stderr[-3000:])
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rank 2 failed: ps task 0 killed by SIGKILL: the rows it held are gone, so the job "
                      "cannot go on (--elastic heals replicas, not ps tasks)"], stderr[-3000:]
    assert ended_after_s is not None and ended_after_s < 30, ended_after_s
    assert_no_processes(str(tmp_path))
