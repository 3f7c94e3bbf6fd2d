"""The Slurm backend's parsing of what Slurm prints, and the srun command lines it builds."""

from __future__ import annotations

import subprocess

import pytest

from distrun.links import srun_argv
from distrun.scheduler._squeue import NEVER_STARTS, Job, parse_squeue, seconds, why_ended
from distrun.scheduler.slurm import _ready_message


@pytest.mark.parametrize("text, expected", [
    ("00:01:00", 60), ("1:30", 90), ("2-00:00:01", 172801), ("12:00:00", 43200), ("UNLIMITED", None),
    ("INVALID", None), ("", None), ("1-x:00", None),
])
def test_slurm_times_in_seconds(text: str, expected: int | None) -> None:
    assert seconds(text) == expected


def test_squeue_lines_become_jobs_and_junk_is_skipped() -> None:
    jobs = parse_squeue("12|RUNNING|None|n[1-2]\n\nsqueue: warning\n13|PENDING|Resources|\n")
    assert [(job.job_id, job.state, job.reason, job.nodelist) for job in jobs] == [
        ("12", "RUNNING", "None", "n[1-2]"), ("13", "PENDING", "Resources", "")]


def test_the_ready_line_is_found_among_whatever_srun_printed() -> None:
    out = 'srun: warning: something\n{"pid": 7, "port": 4000}\n'
    assert _ready_message(out) == {"pid": 7, "port": 4000}
    assert _ready_message('python3: not found\n') == {}
    assert _ready_message('{"error": "a worker server already runs"}') == {"error": "a worker server already runs"}


def test_an_srun_step_passes_argv_through_without_a_shell_reading_it(tmp_path) -> None:
    """The step runs ``sh -c 'cd && exec "$@"' sh ARGV``: ARGV reaches the program as it was given."""
    hostile = ["printf", "%s|", "$(touch x)", "a b", "`id`", ";", "'"]
    argv = srun_argv("12", "n1", hostile)
    assert argv[:argv.index("--")] == ["srun", "--overlap", "--jobid=12", "--nodelist=n1", "--nodes=1", "--ntasks=1",
                                       "--unbuffered", "--quiet", "--job-name=distrun"]
    step = argv[argv.index("--") + 1:]  # what srun would run on the node: run it here
    out = subprocess.run(step, capture_output=True, text=True, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.stdout == "$(touch x)|a b|`id`|;|'|"
    assert not (tmp_path / "x").exists()


_SCONTROL = "JobId=12 JobName=distrun-lab JobState=COMPLETING Reason=None RunTime={ran} TimeLimit={limit} NodeList=n[1-2]"


@pytest.mark.parametrize("job, scontrol, down, said", [
    # Slurm's own verdict, once the job is past COMPLETING
    (Job("12", "TIMEOUT", "TimeLimit", "n[1-2]"), "", "", "TIMEOUT, reason TimeLimit"),
    (Job("12", "CANCELLED", "None", "n[1-2]"), "", "", "CANCELLED"),
    (Job("12", "NODE_FAIL", "NodeDown", "n[1-2]"), "", "n2: Not responding\n",
     "NODE_FAIL, reason NodeDown (nodes down: n2: Not responding)"),
    (Job("12", "PREEMPTED", "None", "n[1-2]"), "", "", "PREEMPTED"),
    # COMPLETING shows no cause: read it from the run time, then the nodes
    (Job("12", "COMPLETING", "None", "n[1-2]"), _SCONTROL.format(ran="02:00:00", limit="02:00:00"), "",
     "TIMEOUT (ran 02:00:00 of its 02:00:00 limit)"),
    (Job("12", "COMPLETING", "None", "n[1-2]"), _SCONTROL.format(ran="00:10:00", limit="UNLIMITED"),
     "n2: Not responding\n", "NODE_FAIL (nodes down: n2: Not responding)"),
    (Job("12", "COMPLETING", "None", "n[1-2]"), _SCONTROL.format(ran="00:10:00", limit="1-00:00:00"), "",
     "CANCELLED (scancel, or its batch script ended; no time limit reached, no node down)"),
])
def test_why_an_allocation_ended_in_one_phrase(job: Job, scontrol: str, down: str, said: str) -> None:
    assert why_ended(job, scontrol=scontrol, nodes_down=down) == said


def test_reasons_that_never_clear_are_named_ones_slurm_prints() -> None:
    assert {"PartitionTimeLimit", "BadConstraints", "QOSMaxNodePerJobLimit"} <= NEVER_STARTS
    assert not {"Resources", "Priority", "JobHeldUser", "ReqNodeNotAvail", "BeginTime"} & NEVER_STARTS
