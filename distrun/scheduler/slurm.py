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
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from distrun.config import Allocation, ClusterSpec, HostSpec, Role, SshSpec
from distrun.errors import HostError
from distrun.links import CommandFailed, Connection, LocalConnection, Remote, Result, SrunLink, last_line
from distrun.scheduler._squeue import FORMAT, NEVER_STARTS, WAITING, Job, parse_squeue, why_ended
from distrun.scheduler.api import NoAllocation, Progress, quiet

__all__ = ["SlurmScheduler", "JOB_NAME_PREFIX", "SERVER_STEP_NAME"]

JOB_NAME_PREFIX = "distrun-"
SERVER_STEP_NAME = "distrun-server"
#: How often `up` asks squeue about a pending allocation.
POLL_S = 0.5
#: squeue failures in a row `up` sits out while it waits (slurmctld busy, rate-limited).
TRANSIENT_FAILURES = 20
#: How long `down` waits for a cancelled allocation to leave squeue (Slurm's KillWait is 30 s by default).
RELEASE_WAIT_S = 90.0
#: How long a node's server may take to start (setup is done before, in steps of its own).
SERVER_START_S = 60.0

_NODE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$")


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
        self._watch_runner: Remote | None = None  # ended() asks once a second: one connection, kept
        self._watch_lock = threading.Lock()

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
            job, owned = self._find(runner)
            if job is None:
                if not allocate:
                    raise NoAllocation(self.label, f"no Slurm allocation for cluster {self.cluster.name!r}; run "
                                                   f"`distrun up {self.cluster.source or ''}`".rstrip() + " first")
                job, owned = self._request(runner, progress), True
            if job.state != "RUNNING":
                if not allocate:
                    raise HostError(self.label, f"Slurm job {job.job_id} is {job.state.lower()} ({job.reason}); "
                                                "`distrun up` waits for it")
                job = self._wait_running(runner, job, progress, owned=owned)
            nodes = self._expand(runner, job.nodelist)
        finally:
            runner.close()
        allocation = Allocation(job_id=job.job_id, nodes=nodes, owned=owned)
        hosts = tuple(HostSpec(address=node, roles=(Role.CHIEF, Role.WORKER) if index == 0 else (Role.WORKER,),
                               ssh=SshSpec(), python=self.spec.python, gpus=self.spec.gpus_per_node)
                      for index, node in enumerate(nodes))
        return replace(self.cluster, hosts=hosts, allocation=allocation)

    def link(self, host: HostSpec) -> Remote:
        allocation = self.cluster.allocation
        assert allocation is not None, "resolve() first"
        return SrunLink(self.runner(), job_id=allocation.job_id, node=host.address, python=host.python)

    def start_server(self, remote: Remote, host: HostSpec, state_dir: str, config: dict[str, Any]) -> Result:
        if not isinstance(remote, SrunLink):
            raise TypeError(f"a Slurm node is reached through an SrunLink, not {type(remote).__name__}")
        result = remote.start_detached(
            [host.python, "-m", "distrun.server", "start", "--attach", "--state-dir", state_dir],
            stdin=json.dumps(config).encode(), step_name=SERVER_STEP_NAME, timeout_s=SERVER_START_S)
        said = _ready_message(result.stdout)
        if result.ok and "port" in said:
            return result
        reason = said.get("error") or last_line(result.stdout) or result.last_line()
        return Result(result.command, result.exited or 1, "", str(reason))

    def ended(self) -> str | None:
        allocation = self.cluster.allocation
        assert allocation is not None, "resolve() first"
        with self._watch_lock:
            if self._watch_runner is None:
                self._watch_runner = self.runner()
            runner = self._watch_runner
            try:
                out = runner.run(["squeue", "--noheader", f"--jobs={allocation.job_id}", "--states=all", FORMAT],
                                 timeout_s=10.0)
                if not out.ok and "Invalid job id" not in out.stderr:
                    return None  # squeue itself failed (slurmctld busy): not a verdict on the job
                jobs = [job for job in parse_squeue(out.stdout) if job.job_id == allocation.job_id]
                nodes = ", ".join(allocation.nodes)
                if not jobs:
                    return f"Slurm job {allocation.job_id} on {nodes} is gone: Slurm no longer lists it"
                job = jobs[0]
                if job.state == "RUNNING":
                    return None
                down = runner.run(["sinfo", "--noheader", "--list-reasons", f"--nodes={','.join(allocation.nodes)}",
                                   "--format=%N: %E"], timeout_s=10.0)
                shown = runner.run(["scontrol", "show", "job", allocation.job_id], timeout_s=10.0)
                why = why_ended(job, scontrol=shown.stdout, nodes_down=down.stdout if down.ok else "")
                return f"Slurm job {allocation.job_id} on {nodes} ended: {why}"
            except HostError:
                runner.close()  # a dropped login connection: open a new one next time
                self._watch_runner = None
                return None

    def close(self) -> None:
        with self._watch_lock:
            if self._watch_runner is not None:
                self._watch_runner.close()
                self._watch_runner = None

    def release(self) -> str | None:
        """End distrun's allocation for the cluster whatever its state: a request still pending
        (an `up` that was killed) must not start later and hold nodes to its time limit."""
        runner = self.runner()
        try:
            job = self._named(runner)
            if job is None:
                return None  # nothing of distrun's; the user's own allocation (SLURM_JOB_ID) is theirs
            self._slurm(runner, ["scancel", job.job_id], f"scancel {job.job_id}")
            deadline = time.monotonic() + RELEASE_WAIT_S
            while time.monotonic() < deadline:
                out = self._slurm(runner, ["squeue", "--noheader", f"--jobs={job.job_id}", FORMAT], "squeue").stdout
                if not parse_squeue(out):  # COMPLETING too: gone means squeue shows nothing of it
                    return f"ended Slurm job {job.job_id}"
                time.sleep(POLL_S)
            raise HostError(self.label, f"Slurm job {job.job_id} is still listed {RELEASE_WAIT_S:g} s after scancel")
        finally:
            runner.close()

    # -- steps

    def _named(self, runner: Remote) -> Job | None:
        """distrun's own allocation for this cluster (``distrun-<name>``), in any live state."""
        out = self._slurm(runner, ["squeue", "--noheader", "--me", f"--name={self.job_name}", FORMAT],
                          "squeue").stdout
        jobs = [job for job in parse_squeue(out) if job.state != "COMPLETING"]
        if len(jobs) > 1:
            ids = ", ".join(job.job_id for job in jobs)
            raise HostError(self.label, f"{len(jobs)} Slurm jobs are named {self.job_name} ({ids}); "
                                        "`scancel` all but one")
        return jobs[0] if jobs else None

    def _find(self, runner: Remote) -> tuple[Job | None, bool]:
        """(the allocation, whether distrun asked for it). distrun's own comes first: a command run
        from some other salloc shell must not be pointed at that shell's nodes."""
        named = self._named(runner)
        if named is not None or self.inside is None:
            return named, True
        out = self._slurm(runner, ["squeue", "--noheader", f"--jobs={self.inside}", FORMAT], "squeue").stdout
        jobs = parse_squeue(out)
        if not jobs:
            raise HostError(self.label, f"SLURM_JOB_ID={self.inside} names no live Slurm job; unset it to "
                                        "let `distrun up` ask for an allocation")
        return jobs[0], False

    def _request(self, runner: Remote, progress: Progress) -> Job:
        progress(self.label, "asking for an allocation (sbatch)")
        # --no-requeue: after a node failure the holder must not come back on new nodes without servers.
        # --signal: the warning before the time limit goes to every step (the servers pass it on).
        argv = ["sbatch", "--parsable", f"--job-name={self.job_name}", "--output=/dev/null", "--no-requeue",
                f"--signal=USR1@{self.spec.grace_s}", *self.spec.sbatch_args(), "--wrap=trap '' USR1; exec sleep infinity"]
        out = self._slurm(runner, argv, "asking for an allocation (sbatch)").stdout.strip()
        job_id = out.split(";", 1)[0]
        if not job_id.isdigit():
            raise HostError(self.label, f"sbatch answered {out[:80]!r}, not a job id")
        return Job(job_id, "PENDING", "submitted", "")

    def _wait_running(self, runner: Remote, job: Job, progress: Progress, *, owned: bool) -> Job:
        failures = 0
        try:
            while True:
                result = runner.run(["squeue", "--noheader", f"--jobs={job.job_id}", FORMAT], timeout_s=30.0)
                if not result.ok and "Invalid job id" not in result.stderr:
                    failures += 1  # slurmctld busy: a long wait must not end on one refusal
                    if failures >= TRANSIENT_FAILURES:
                        raise CommandFailed(self.label, result, "squeue")
                    time.sleep(POLL_S * 2)
                    continue
                failures = 0
                found = parse_squeue(result.stdout)
                if not found:
                    raise HostError(self.label, f"Slurm job {job.job_id} ended before it started")
                job = found[0]
                if job.state == "RUNNING":
                    return job
                if job.state not in WAITING:
                    raise HostError(self.label, f"Slurm job {job.job_id} is {job.state.lower()} ({job.reason})")
                if job.reason.split(",")[0] in NEVER_STARTS:  # withdrawn below, as on any error
                    raise HostError(self.label, f"Slurm job {job.job_id} cannot start: {job.reason}"
                                                + ("; the request was withdrawn (scancel)" if owned else ""))
                progress(self.label, f"job {job.job_id} {job.state.lower()}: {job.reason}")
                time.sleep(POLL_S)
        except BaseException:
            if owned:  # a request nobody waits for any more (Ctrl-C, SIGTERM, an error) must not start later
                runner.run(["scancel", job.job_id])
            raise

    def _expand(self, runner: Remote, nodelist: str) -> tuple[str, ...]:
        out = self._slurm(runner, ["scontrol", "show", "hostnames", nodelist], "scontrol show hostnames").stdout
        nodes = tuple(line.strip() for line in out.splitlines() if line.strip())
        bad = [node for node in nodes if not _NODE.match(node)]
        if not nodes or bad:
            raise HostError(self.label, f"Slurm named the nodes {nodelist!r}, which distrun cannot use as host names")
        return nodes


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

