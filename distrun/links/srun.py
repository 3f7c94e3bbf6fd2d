"""A node of a Slurm allocation as a host: every command is an ``srun`` step on it.

Compute nodes are reached through Slurm, not SSH (outside an allocation there
is often no SSH to them at all). ``srun --overlap --jobid J --nodelist NODE``
starts a one-task step that shares the allocation's resources with the worker
server's own step, and ``--unbuffered`` makes its stdout a byte pipe: commands,
files and the stream to the worker server all ride on it. The stream is a
relay on the node (``python -m distrun.server relay``) joined to the server's
loopback port, so the server is reached only through the allocation's own srun
channel and then its token, as over SSH.

``runner`` is where Slurm's commands run: this machine (inside an allocation,
or on a login node) or an SSH connection to the login node (the laptop).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from distrun.errors import HostError, HostUnreachable
from distrun.links.api import RawResult, Remote, Result, last_line
from distrun.protocol.wire import Stream

__all__ = ["SrunLink", "srun_argv"]

#: Relative paths start at the home directory, as an SSH login's do; argv stays quoted ("$@").
_IN_HOME = 'cd && exec "$@"'
#: What srun says when the allocation is over (scancel, time limit, a failed node).
_GONE = re.compile(r"Invalid job id|Unable to confirm allocation|Job has expired|job .* has (?:expired|been revoked)",
                   re.IGNORECASE)
#: srun's own report of a task's exit: the task's last line says more.
_TASK_EXIT = re.compile(r"^srun: error: \S+: task \d+: (?:Exited with exit code \d+|Killed)\s*$")

#: Starts a step detached from the command that starts it: its stdin (a configuration) goes
#: in through a file unlinked once open, so it never shows in ps; the step's first line of
#: output that says ``"ready"`` or ``"error"`` (the worker server's ready message) comes
#: back; the step goes on in a session of its own after this command returns. A step that
#: neither answers nor ends within $LIMIT ticks of 0.05 s is ended.
_DETACH = r"""
umask 077
conf=$(mktemp) && out=$(mktemp) || exit 1
cat >"$conf"
exec 3<"$conf"
rm -f -- "$conf"
setsid "$@" <&3 >"$out" 2>&1 &
pid=$!
exec 3<&-
n=0
while kill -0 "$pid" 2>/dev/null && ! grep -qE '"(port|error)"' "$out" && [ "$n" -lt "$LIMIT" ]; do
  sleep 0.05; n=$((n + 1))
done
said=$(cat -- "$out")
rm -f -- "$out"
printf '%s\n' "$said"
case "$said" in *'"port"'*) kill -0 "$pid" 2>/dev/null && exit 0 ;; esac
kill "$pid" 2>/dev/null
exit 1
"""


def srun_argv(job_id: str, node: str, argv: Sequence[str], *, step_name: str = "distrun",
              whole: bool = False) -> list[str]:
    """One task on ``node`` of job ``job_id`` running ``argv`` from the home directory.

    ``whole``: the step gets every resource the job holds on the node (the worker
    server's step, whose training processes need all the CPUs and GPUs).
    """
    return ["srun", "--overlap", f"--jobid={job_id}", f"--nodelist={node}", "--nodes=1", "--ntasks=1",
            "--unbuffered", "--quiet", f"--job-name={step_name}", *(["--whole"] if whole else []),
            "--", "sh", "-c", _IN_HOME, "sh", *argv]


class SrunLink:
    """``Remote`` for one node of allocation ``job_id``; Slurm's commands run through ``runner``."""

    def __init__(self, runner: Remote, *, job_id: str, node: str, python: str) -> None:
        self.runner = runner
        self.job_id = job_id
        self.node = node
        self.label = node
        self.python = python

    def run(self, argv: Sequence[str], *, stdin: str | None = None, timeout_s: float = 60.0) -> Result:
        return self.run_raw(argv, stdin=stdin.encode() if stdin is not None else None, timeout_s=timeout_s).text()

    def run_raw(self, argv: Sequence[str], *, stdin: bytes | None = None, timeout_s: float = 60.0) -> RawResult:
        result = self.runner.run_raw(srun_argv(self.job_id, self.node, argv), stdin=stdin, timeout_s=timeout_s)
        if result.exited == 0:
            return result
        text = result.stderr.decode(errors="replace")
        if _GONE.search(text) and "srun: error" in text:
            why = last_line(text).removeprefix("srun: error: ") or "no reason given"
            raise HostUnreachable(self.label, f"Slurm job {self.job_id} is gone ({why}); "
                                              "run `distrun up` for a new allocation")
        kept = "\n".join(line for line in text.splitlines() if not _TASK_EXIT.match(line.strip()))
        return RawResult(result.command, result.exited, result.stdout, kept.encode())

    def read_file(self, path: str) -> str | None:
        result = self.run_raw(["cat", "--", path])
        if result.exited != 0 and b"No such file" in result.stderr:
            return None
        if result.exited != 0:
            raise HostError(self.label, f"cannot read {path}: {result.text().last_line()}")
        return result.stdout.decode()

    def read_bytes(self, path: str) -> bytes:
        result = self.run_raw(["cat", "--", path], timeout_s=600.0)
        if result.exited != 0:
            raise HostError(self.label, f"cannot read {path}: {result.text().last_line()}")
        return result.stdout

    def write_file(self, path: str, data: bytes) -> None:
        tmp = f"{path}.distrun-{self.job_id}.tmp"
        script = 'umask 077 && cat > "$1" && mv -f -- "$1" "$2"'
        result = self.run_raw(["sh", "-c", script, "sh", tmp, path], stdin=data, timeout_s=600.0)
        if result.exited != 0:
            raise HostError(self.label, f"cannot write {path}: {result.text().last_line()}")

    def start_detached(self, argv: Sequence[str], *, stdin: bytes, step_name: str, timeout_s: float) -> Result:
        """``argv`` as a step of its own on the node (``--whole``: all the job holds there) that
        outlives this call, held by an ``srun`` in a session of its own where Slurm's commands
        run. A step's processes end with the step, so a long-lived process (the worker
        server) must be a step, not a daemon a short step leaves behind. The result's stdout
        is the step's first line that says ``"port"`` or ``"error"``."""
        step = srun_argv(self.job_id, self.node, argv, step_name=step_name, whole=True)
        ticks = str(max(1, int(timeout_s / 0.05)))
        return self.runner.run_raw(["env", f"LIMIT={ticks}", "sh", "-c", _DETACH, "sh", *step], stdin=stdin,
                                   timeout_s=timeout_s + 30).text()

    def open_command(self, argv: Sequence[str]) -> Stream:
        return self.runner.open_command(srun_argv(self.job_id, self.node, argv))

    def open_stream(self, port: int) -> Stream:
        return self.open_command([self.python, "-m", "distrun.server", "relay", "--port", str(port)])

    def close(self) -> None:
        self.runner.close()

    def __enter__(self) -> SrunLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

