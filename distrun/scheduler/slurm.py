"""Slurm: the cluster's hosts are the nodes of an allocation, reached through ``srun``.

``distrun up`` asks for an allocation with ``sbatch`` (a job named
``distrun-<cluster name>`` that only holds the nodes) and waits, showing the
reason squeue gives, until it runs; or, when the client already runs inside an
allocation (``SLURM_JOB_ID``: the user's sbatch script, a salloc shell), uses
that one and asks for nothing. Every later command finds the allocation again
by its name, so no state is kept on the client and any shell (or the laptop,
through the login node) can drive the cluster.

Each node's worker server runs as an ``srun`` step of its own, launched
detached from where Slurm's commands run: a step's processes end with the step
(Slurm tracks them), so the server must be the step, not a daemon a short step
left behind. ``down`` stops the servers (their steps end), and ends the
allocation only if distrun asked for it.

Slurm's commands run on this machine, or with ``slurm.login`` on the login node
over SSH; either way each is one argv, quoted, never a shell line built from
the cluster file.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from distrun.config import Allocation, ClusterSpec, HostSpec, Role, SshSpec
from distrun.errors import HostError
from distrun.links import CommandFailed, Connection, LocalConnection, Remote, Result, SrunLink, srun_argv
from distrun.scheduler.api import NoAllocation, Progress, quiet

__all__ = ["SlurmScheduler", "JOB_NAME_PREFIX", "SERVER_STEP_NAME"]

JOB_NAME_PREFIX = "distrun-"
SERVER_STEP_NAME = "distrun-server"
#: How often `up` asks squeue about a pending allocation.
POLL_S = 0.5
#: How long `down` waits for a cancelled allocation to leave squeue's running jobs.
RELEASE_WAIT_S = 15.0
#: How long a node's server may take to start (setup is done before, in steps of its own).
SERVER_START_S = 60.0

#: Starts the server step detached from this command: its config goes in on stdin
#: (through a file unlinked once open, so it never shows in ps), its first line of
#: output (the server's ready message, or an error) comes back, and the step goes
#: on in a session of its own after this command returns.
_LAUNCH = r"""
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

_NODE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$")
_WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "RESIZING"}


@dataclass(frozen=True)
class _Job:
    job_id: str
    state: str
    reason: str
    nodelist: str


class SlurmScheduler:
    """A ``scheduler: slurm`` cluster file's allocation and nodes."""

    def __init__(self, cluster: ClusterSpec, env: Mapping[str, str] | None = None) -> None:
        assert cluster.slurm is not None
        self.cluster = cluster
        self.spec = cluster.slurm
        env = os.environ if env is None else env
        # Inside an allocation only when Slurm's commands run here: SLURM_JOB_ID names a local job.
        self.inside = env.get("SLURM_JOB_ID") if self.spec.login is None else None
        self.job_name = f"{JOB_NAME_PREFIX}{cluster.name}"
        self.label = "slurm" if self.spec.login is None else f"slurm@{self.spec.login.label}"

    # -- where Slurm's commands run

    def runner(self) -> Remote:
        login = self.spec.login
        return LocalConnection(self.label) if login is None else Connection(login)

    def _slurm(self, runner: Remote, argv: list[str], what: str, *, timeout_s: float = 30.0) -> Result:
        result = runner.run(argv, timeout_s=timeout_s)
        if result.exited == 127:
            where = "this machine" if self.spec.login is None else self.spec.login.label
            raise HostError(self.label, f"{argv[0]} not found on {where}: Slurm's commands must run there "
                                        "(on a laptop, set slurm.login to the cluster's login node)")
        if not result.ok:
            raise CommandFailed(self.label, result, what)
        return result

    # -- the Scheduler contract

    def resolve(self, *, allocate: bool = False, progress: Progress = quiet) -> ClusterSpec:
        runner = self.runner()
        try:
            job = self._find(runner)
            if job is None:
                if not allocate:
                    raise NoAllocation(self.label, f"no Slurm allocation for cluster {self.cluster.name!r}; run "
                                                f"`distrun up {self.cluster.source or ''}`".rstrip() + " first")
                job = self._request(runner, progress)
            if job.state != "RUNNING":
                if not allocate:
                    raise HostError(self.label, f"Slurm job {job.job_id} is {job.state.lower()} ({job.reason}); "
                                                "`distrun up` waits for it")
                job = self._wait_running(runner, job, progress, cancel_on_interrupt=self.inside is None)
            nodes = self._expand(runner, job.nodelist)
        finally:
            runner.close()
        allocation = Allocation(job_id=job.job_id, nodes=nodes, owned=self.inside is None)
        hosts = tuple(HostSpec(address=node, roles=(Role.CHIEF, Role.WORKER) if index == 0 else (Role.WORKER,),
                               ssh=SshSpec(), python=self.spec.python, gpus=self.spec.gpus_per_node)
                      for index, node in enumerate(nodes))
        return replace(self.cluster, hosts=hosts, allocation=allocation)

    def link(self, host: HostSpec) -> Remote:
        allocation = self.cluster.allocation
        assert allocation is not None, "resolve() first"
        return SrunLink(self.runner(), job_id=allocation.job_id, node=host.address, python=host.python)

    def start_server(self, remote: Remote, host: HostSpec, state_dir: str, config: dict[str, Any]) -> Result:
        assert isinstance(remote, SrunLink)
        step = srun_argv(remote.job_id, remote.node,
                         [host.python, "-m", "distrun.server", "start", "--attach", "--state-dir", state_dir],
                         step_name=SERVER_STEP_NAME, whole=True)
        limit = str(int(SERVER_START_S / 0.05))
        result = remote.runner.run(["env", f"LIMIT={limit}", "sh", "-c", _LAUNCH, "sh", *step],
                                   stdin=json.dumps(config), timeout_s=SERVER_START_S + 30)
        said = _ready_message(result.stdout)
        if result.ok and "port" in said:
            return result
        reason = said.get("error") or _last_line(result.stdout) or result.last_line()
        return Result(result.command, result.exited or 1, "", str(reason))

    def ended(self) -> str | None:
        allocation = self.cluster.allocation
        assert allocation is not None, "resolve() first"
        runner = self.runner()
        try:
            out = runner.run(["squeue", "--noheader", f"--jobs={allocation.job_id}", "--states=all",
                              "--format=%i|%T|%r|%N"], timeout_s=10.0)
            if not out.ok and "Invalid job id" not in out.stderr:
                return None  # squeue itself failed (slurmctld busy): not a verdict on the job
            jobs = [job for job in _parse_squeue(out.stdout) if job.job_id == allocation.job_id]
            nodes = ", ".join(allocation.nodes)
            if not jobs:
                return f"Slurm job {allocation.job_id} on {nodes} is gone: Slurm no longer lists it"
            job = jobs[0]
            if job.state == "RUNNING":
                return None
            return f"Slurm job {allocation.job_id} on {nodes} ended: {self._why(runner, job, allocation)}"
        except HostError:
            return None
        finally:
            runner.close()

    def _why(self, runner: Remote, job: _Job, allocation: Allocation) -> str:
        """Slurm's state and reason. While Slurm still ends the job's processes (COMPLETING, as long
        as KillWait) it shows no cause, so the cause is read from what else it says: the run time
        against the limit, the nodes' own state."""
        down = runner.run(["sinfo", "--noheader", "--list-reasons", f"--nodes={','.join(allocation.nodes)}",
                           "--format=%N: %E"], timeout_s=10.0)
        failed = "; ".join(line.strip() for line in down.stdout.splitlines() if line.strip()) if down.ok else ""
        if job.state != "COMPLETING":
            why = "" if job.reason in ("", "None") else f", reason {job.reason}"
            return f"{job.state}{why}" + (f" (nodes down: {failed})" if failed and job.state == "NODE_FAIL" else "")
        shown = runner.run(["scontrol", "show", "job", allocation.job_id], timeout_s=10.0).stdout
        fields = dict(item.split("=", 1) for item in shown.split() if "=" in item)
        ran_s, limit_s = _seconds(fields.get("RunTime", "")), _seconds(fields.get("TimeLimit", ""))
        if ran_s is not None and limit_s is not None and ran_s >= limit_s:
            return f"TIMEOUT (ran {fields['RunTime']} of its {fields['TimeLimit']} limit)"
        if failed:
            return f"NODE_FAIL (nodes down: {failed})"
        return "CANCELLED (scancel, or its batch script ended; no time limit reached, no node down)"

    def release(self) -> str | None:
        if self.inside is not None:
            return None  # the user's own allocation: its servers are stopped, the allocation is theirs
        runner = self.runner()
        try:
            job = self._find(runner)
            if job is None:
                return None
            self._slurm(runner, ["scancel", job.job_id], f"scancel {job.job_id}")
            deadline = time.monotonic() + RELEASE_WAIT_S
            while time.monotonic() < deadline:
                if self._find(runner) is None:
                    return f"ended Slurm job {job.job_id}"
                time.sleep(POLL_S)
            raise HostError(self.label, f"Slurm job {job.job_id} is still listed {RELEASE_WAIT_S:g} s after scancel")
        finally:
            runner.close()

    # -- steps

    def _find(self, runner: Remote) -> _Job | None:
        fmt = "--format=%i|%T|%r|%N"
        if self.inside is not None:
            out = self._slurm(runner, ["squeue", "--noheader", f"--jobs={self.inside}", fmt], "squeue").stdout
            jobs = _parse_squeue(out)
            if not jobs:
                raise HostError(self.label, f"SLURM_JOB_ID={self.inside} names no live Slurm job; unset it to "
                                            "let `distrun up` ask for an allocation")
            return jobs[0]
        out = self._slurm(runner, ["squeue", "--noheader", "--me", f"--name={self.job_name}", fmt], "squeue").stdout
        jobs = [job for job in _parse_squeue(out) if job.state not in ("COMPLETING",)]
        if len(jobs) > 1:
            ids = ", ".join(job.job_id for job in jobs)
            raise HostError(self.label, f"{len(jobs)} Slurm jobs are named {self.job_name} ({ids}); "
                                        "`scancel` all but one")
        return jobs[0] if jobs else None

    def _request(self, runner: Remote, progress: Progress) -> _Job:
        progress(self.label, "asking for an allocation (sbatch)")
        argv = ["sbatch", "--parsable", f"--job-name={self.job_name}", "--output=/dev/null",
                *self.spec.sbatch_args(), "--wrap=exec sleep infinity"]
        out = self._slurm(runner, argv, "asking for an allocation (sbatch)").stdout.strip()
        job_id = out.split(";", 1)[0]
        if not job_id.isdigit():
            raise HostError(self.label, f"sbatch answered {out[:80]!r}, not a job id")
        return _Job(job_id, "PENDING", "submitted", "")

    def _wait_running(self, runner: Remote, job: _Job, progress: Progress, *, cancel_on_interrupt: bool) -> _Job:
        try:
            while True:
                out = self._slurm(runner, ["squeue", "--noheader", f"--jobs={job.job_id}",
                                           "--format=%i|%T|%r|%N"], "squeue").stdout
                found = _parse_squeue(out)
                if not found:
                    raise HostError(self.label, f"Slurm job {job.job_id} ended before it started")
                job = found[0]
                if job.state == "RUNNING":
                    return job
                if job.state not in _WAITING:
                    raise HostError(self.label, f"Slurm job {job.job_id} is {job.state.lower()} ({job.reason})")
                progress(self.label, f"job {job.job_id} {job.state.lower()}: {job.reason}")
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            if cancel_on_interrupt:  # a request nobody waits for any more must not start later
                runner.run(["scancel", job.job_id])
            raise

    def _expand(self, runner: Remote, nodelist: str) -> tuple[str, ...]:
        out = self._slurm(runner, ["scontrol", "show", "hostnames", nodelist], "scontrol show hostnames").stdout
        nodes = tuple(line.strip() for line in out.splitlines() if line.strip())
        bad = [node for node in nodes if not _NODE.match(node)]
        if not nodes or bad:
            raise HostError(self.label, f"Slurm named the nodes {nodelist!r}, which distrun cannot use as host names")
        return nodes


def _parse_squeue(out: str) -> list[_Job]:
    jobs = []
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0]:
            jobs.append(_Job(*parts))
    return jobs


def _ready_message(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                return message
    return {}


def _seconds(text: str) -> int | None:
    """Slurm's ``[D-]HH:MM:SS`` (or ``MM:SS``) in seconds; None for UNLIMITED or anything else."""
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not all(part.isdigit() for part in parts) or not 2 <= len(parts) <= 3 or (days and not days.isdigit()):
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return seconds + int(days or 0) * 86400


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
