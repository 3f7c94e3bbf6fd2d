"""The Slurm backend's parsing of what Slurm prints, and the srun command lines it builds."""

from __future__ import annotations

import subprocess

import pytest

from distrun.links import srun_argv
from distrun.scheduler.slurm import _parse_squeue, _ready_message, _seconds


@pytest.mark.parametrize("text, seconds", [
    ("00:01:00", 60), ("1:30", 90), ("2-00:00:01", 172801), ("12:00:00", 43200), ("UNLIMITED", None),
    ("INVALID", None), ("", None), ("1-x:00", None),
])
def test_slurm_times_in_seconds(text: str, seconds: int | None) -> None:
    assert _seconds(text) == seconds


def test_squeue_lines_become_jobs_and_junk_is_skipped() -> None:
    jobs = _parse_squeue("12|RUNNING|None|n[1-2]\n\nsqueue: warning\n13|PENDING|Resources|\n")
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
