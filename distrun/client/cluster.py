"""`up`, `status` and `down`: every host in parallel, one row per host, never a hang.

Per host the client holds one ``Remote`` (an SSH connection, an srun link to a
Slurm node, or this machine for the embedded default) and does everything
through it: find or build its Python environment (``_environment``: the cluster file's
``requirements:`` and ``wheels:``, and distrun itself from the client when the host's
python lacks it), run ``setup``, check the interpreter and distrun's version, start
the server so it outlives the command (detached; on Slurm, as a step of its
own), read its state file (port and token, 0600), and reach it through a
channel to the host's loopback. A failure on one host becomes that host's row
(down, error) and never stops the others. The hosts themselves come from the
cluster's scheduler: the file's list, or a Slurm allocation ``up`` asks for and
``down`` gives back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from distrun._version import __version__
from distrun.client._environment import (
    EnvironmentFailed,
    EnvironmentPlan,
    HostEnvironment,
    build_environment,
    check_environment,
    plan_environment,
)
from distrun.client._links import connect, open_remote, read_server_state
from distrun.client.history import history_dir, keep_host_history
from distrun.config.cluster import ClusterSpec, HostSpec
from distrun.errors import HostError, HostKeyError, HostUnreachable
from distrun.links import CommandFailed, Remote
from distrun.protocol.cluster import ClusterReport, HostRow, HostStatus, ServerInfo, ServerState, config_digest
from distrun.scheduler import NoAllocation, resolve, scheduler_for

__all__ = ["cluster_up", "cluster_status", "cluster_down", "Progress"]

#: One setup command may take this long (a pip install over a slow mirror).
SETUP_TIMEOUT_S = 1800.0
#: How long `down` waits for a server to exit on its own before the sweep kills what is left.
STOP_WAIT_S = 5.0
#: In a host's state folder: the interpreter its server was started with (an environment's, maybe).
_INTERPRETER_FILE = "interpreter"
_PROBE = "import sys; print(sys.version.split()[0]); import distrun; print(distrun.__version__)"

Progress = Callable[[str, str], None]
"""Called as ``progress(host_label, stage)`` while a command works on a host."""


def _quiet(_host: str, _stage: str) -> None:
    pass


def cluster_up(cluster: ClusterSpec, *, run_setup: bool = True, progress: Progress = _quiet) -> ClusterReport:
    """Two passes over the hosts, each in parallel: first every host's environment (found or built)
    and whether its server can be kept; then, only if no environment failed anywhere, the servers
    started. A failed install thus leaves every host's server as it was."""
    cluster = resolve(cluster, allocate=True, progress=progress)
    plan = plan_environment(cluster)
    ops = {host: _HostOps(cluster, host, progress) for host in cluster.hosts}
    try:
        first = _in_parallel(cluster, lambda host: ops[host].prepare(plan, run_setup=run_setup))
        failed = [row.host for _, row, error in first if isinstance(error, EnvironmentFailed)]
        if failed:
            rows = [row or ops[host].left_as_it_was(failed) for host, row, _ in first]
        else:
            started = _in_parallel(cluster, lambda host: ops[host].finish(),
                                   only=[host for host, row, _ in first if row is None])
            done = {host: row for host, row, _ in started}
            rows = [row or done[host] for host, row, _ in first]
        return ClusterReport(cluster=cluster.name, command="up", rows=tuple(rows))
    finally:
        for op in ops.values():
            op.close()


def cluster_status(cluster: ClusterSpec, *, progress: Progress = _quiet) -> ClusterReport:
    try:
        cluster = resolve(cluster, progress=progress)
    except HostError as exc:
        return _no_hosts(cluster, "status", exc)
    return _each_host(cluster, "status", lambda host: _HostOps(cluster, host, progress).status())


def cluster_down(cluster: ClusterSpec, *, progress: Progress = _quiet, history_home: str | None = None) -> ClusterReport:
    """Stop every server and check each host; then give back the allocation ``up`` asked for, if any
    (whatever its state: a request still pending must not start later and hold nodes). ``history_home``:
    where a cluster file's hosts' finished jobs are kept once their servers have stopped
    (``$DISTRUN_HOME``: ``client/history``; the embedded local cluster's stay where they are)."""
    try:
        resolved = resolve(cluster, progress=progress)
    except HostError as exc:  # no allocation, or one still pending: nothing runs on it yet
        if cluster.slurm is None:
            return _no_hosts(cluster, "down", exc)
        released = _released(cluster, ClusterReport(cluster=cluster.name, command="down", rows=()), progress)
        return released if released.rows else _no_hosts(cluster, "down", exc)
    keep = None if history_home is None or resolved.local or cluster.source is None \
        else history_dir(history_home, Path(cluster.source), cluster.name)
    report = _each_host(resolved, "down", lambda host: _HostOps(resolved, host, progress).down(keep))
    if resolved.allocation is None:
        return report
    if not resolved.allocation.owned:
        row = HostRow(f"slurm job {resolved.allocation.job_id}", (), HostStatus.NOT_RUNNING,
                      message="the allocation is the caller's own (SLURM_JOB_ID): left running")
        return ClusterReport(cluster=report.cluster, command="down", rows=(*report.rows, row))
    # Also when a host was not clean: ending the allocation is how Slurm ends what is left there.
    return _released(resolved, report, progress)


def _released(cluster: ClusterSpec, report: ClusterReport, progress: Progress) -> ClusterReport:
    """``report`` with a row for distrun's allocation, ended (scancel) and gone from squeue."""
    label = f"slurm job {cluster.allocation.job_id}" if cluster.allocation else "slurm"
    progress(label, "ending the allocation")
    try:
        done = scheduler_for(cluster).release()
    except HostError as exc:
        row = HostRow(label, (), HostStatus.ERROR, message=exc.reason, exit_code=exc.exit_code)
    else:
        if done is None and cluster.allocation is None:
            return report  # nothing was there: the "no allocation" row says so
        row = HostRow(label, (), HostStatus.STOPPED if done else HostStatus.NOT_RUNNING,
                      message=done or "no allocation of distrun's was left")
    return ClusterReport(cluster=report.cluster, command="down", rows=(*report.rows, row))


def _no_hosts(cluster: ClusterSpec, command: str, exc: HostError) -> ClusterReport:
    """A cluster whose hosts cannot be known (no Slurm allocation): one row that says why."""
    none = isinstance(exc, NoAllocation)
    row = HostRow(exc.host, (), HostStatus.NOT_RUNNING if none else HostStatus.ERROR, message=exc.reason,
                  exit_code=0 if none and command == "down" else exc.exit_code)
    return ClusterReport(cluster=cluster.name, command=command, rows=(row,))


def _each_host(cluster: ClusterSpec, command: str, work: Callable[[HostSpec], HostRow]) -> ClusterReport:
    rows = tuple(row for _, row, _ in _in_parallel(cluster, work) if row is not None)
    return ClusterReport(cluster=cluster.name, command=command, rows=rows)


def _in_parallel(cluster: ClusterSpec, work: Callable[[HostSpec], HostRow | None],
                 only: list[HostSpec] | None = None) -> list[tuple[HostSpec, HostRow | None, HostError | None]]:
    """``work`` on every host (or ``only`` these) at once: (host, its row, the error behind the row).
    A HostError becomes that host's row (down, error) and never stops the others."""
    def guarded(host: HostSpec) -> tuple[HostSpec, HostRow | None, HostError | None]:
        try:
            return host, work(host), None
        except HostError as exc:
            down = isinstance(exc, (HostUnreachable, HostKeyError))
            status = HostStatus.DOWN if down else HostStatus.ERROR
            return host, HostRow(host=host.label, roles=_roles(host), status=status, message=exc.reason,
                                 exit_code=exc.exit_code), exc

    hosts = cluster.hosts if only is None else only
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return list(pool.map(guarded, hosts))


def _roles(host: HostSpec) -> tuple[str, ...]:
    return tuple(role.value for role in host.roles)


def slots_for(host: HostSpec, info: ServerInfo) -> tuple[int, int]:
    """(training processes, GPUs) on a host: ``slots``, else its GPU count, else 1."""
    gpus = info.gpu_count if host.gpus is None else host.gpus
    return host.slots or (gpus if gpus > 0 else 1), gpus


class _HostOps:
    """What up/status/down do on one host, through one link to it."""

    def __init__(self, cluster: ClusterSpec, host: HostSpec, progress: Progress) -> None:
        self.cluster = cluster
        self.host = host
        self.label = host.label
        self.state_dir = cluster.host_state_dir(host)
        self.config: dict[str, object] = {"env": dict(cluster.env)}
        self.progress = progress
        self._link: Remote | None = None  # `up`'s, kept open between its two passes
        self._state: ServerState | None = None
        self._live: tuple[ServerInfo, float] | None = None
        self._env: HostEnvironment | None = None

    @contextmanager
    def _remote(self) -> Iterator[Remote]:
        remote = open_remote(self.cluster, self.host)
        try:
            yield remote
        finally:
            remote.close()

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    # -- the three commands (`up` in two passes: prepare on every host, then finish)

    def prepare(self, plan: EnvironmentPlan, *, run_setup: bool) -> HostRow | None:
        """The host's environment, found or built; a row if its running server is kept, else None."""
        self._link = remote = open_remote(self.cluster, self.host)
        self.progress(self.label, "connecting")
        self._state = self._read_state(remote)
        if self._state is not None:
            self.progress(self.label, "checking the running server")
            self._live = self._try_status(remote, self._state)
        self.progress(self.label, "checking the environment")
        env = check_environment(remote, self.host, plan)
        # The interpreter is part of what a server was started with: a changed `python:`,
        # `requirements:` or `wheels:` makes a running server stale, as a changed `env` does.
        self.config = {"env": dict(self.cluster.env), "python": env.python}
        if self._live is not None and env.ready:
            info, rtt_ms = self._live
            if info.version == __version__ and info.config_sha256 == config_digest(self.config):
                return self._row(HostStatus.UP, info, rtt_ms, note=env.note)
        if run_setup:
            self._setup(remote)
        if not env.ready:
            self.progress(self.label, "sending wheels" if not env.wheels_ready else "building the environment")
            env = build_environment(remote, self.host, plan, env)
        self._env = env
        return None

    def finish(self) -> HostRow:
        """Replace a stale or dead server, or start one, on the environment ``prepare`` found."""
        assert self._link is not None and self._env is not None, "prepare() first"
        remote, env = self._link, self._env
        if self._live is not None and self._state is not None:
            self._stop_server(remote, self._state)  # stale: another version, env or interpreter
        self.progress(self.label, "checking python and distrun")
        self._probe(remote, env.python)
        self.progress(self.label, "starting the worker server")
        self._sweep(remote, kill=True, python=env.python)  # a dead server's orphans must not outlive it
        state = self._start(remote, env.python)
        live = self._try_status(remote, state)
        if live is None:
            raise HostError(self.label, f"the worker server started (pid {state.pid}) but does not answer; "
                                        f"see {self.state_dir}/server.log on the host")
        status = HostStatus.RESTARTED if self._state is not None else HostStatus.STARTED
        return self._row(status, *live, note=env.note)

    def left_as_it_was(self, failed: list[str]) -> HostRow:
        """This host's row when another host's environment failed: its server was not touched."""
        why = f"left as it was: the environment failed on {', '.join(failed)}"
        if self._live is not None:
            return self._row(HostStatus.UP, *self._live, note=f"{why} (its server runs as before)")
        return HostRow(self.label, _roles(self.host), HostStatus.NOT_RUNNING, message=f"{why}; no server started")

    def status(self) -> HostRow:
        with self._remote() as remote:
            state = self._read_state(remote)
            if state is None:
                return HostRow(self.label, _roles(self.host), HostStatus.NOT_RUNNING,
                               message="no worker server; run `distrun up`", exit_code=HostError.exit_code)
            live = self._try_status(remote, state)
            if live is None:
                return HostRow(self.label, _roles(self.host), HostStatus.NOT_RUNNING,
                               message=f"server pid {state.pid} does not answer; run `distrun up`",
                               exit_code=HostError.exit_code)
            return self._row(HostStatus.UP, *live)

    def down(self, history: Path | None = None) -> HostRow:
        with self._remote() as remote:
            state = self._read_state(remote)
            stopped = False
            if state is not None:
                self.progress(self.label, "stopping the worker server")
                stopped = self._stop_server(remote, state)
            self.progress(self.label, "checking for leftover processes")
            swept = self._sweep(remote, kill=True)  # with the interpreter `up` started the server with
            found, left = swept["found"], swept["left"]
            message = f"ended {len(found)} leftover process(es)" if found else "no process of distrun's left"
            if left:
                message = f"{len(left)} process(es) would not die: pids {left}"
            if history is not None:  # after the server stopped: the jobs it stopped are finished too
                message += self._keep_history(remote, history)
            status = HostStatus.STOPPED if (stopped or found) else HostStatus.NOT_RUNNING
            return HostRow(self.label, _roles(self.host), status, message=message, processes_left=len(left),
                           exit_code=HostError.exit_code if left else 0)

    # -- steps

    def _read_state(self, remote: Remote) -> ServerState | None:
        return read_server_state(remote, self.state_dir)

    def _try_status(self, remote: Remote, state: ServerState) -> tuple[ServerInfo, float] | None:
        try:
            with connect(remote, state, self.label) as client:
                return client.status()
        except HostError:
            return None

    def _setup(self, remote: Remote) -> None:
        for index, command in enumerate(self.cluster.setup):
            self.progress(self.label, f"setup[{index}]")
            # The user's own shell command, passed whole as one quoted argument.
            result = remote.run(["sh", "-c", command], timeout_s=SETUP_TIMEOUT_S)
            if not result.ok:
                raise CommandFailed(self.label, result, f"setup[{index}] ({command!r})")

    def _probe(self, remote: Remote, python: str) -> None:
        result = remote.run([python, "-c", _PROBE])
        where = self.cluster.source or "the cluster file"
        if result.exited == 127 or (not result.stdout.strip() and "No such file" in result.stderr):
            raise HostError(self.label, f"python {python!r} not found; set `python:` in {where} to an "
                                        "interpreter that exists on this host")
        lines = result.stdout.split()
        if "No module named" in result.stderr and "distrun" in result.stderr:
            # `up` brings distrun from the client to any Python that runs its environment check.
            raise HostError(self.label, f"distrun is not installed for {python}, and `up` could not bring the "
                                        f"client's (its environment check needs Python 3.10+); set `python:` in "
                                        f"{where} to one, or install distrun=={__version__} there")
        if not result.ok or len(lines) < 2:
            raise CommandFailed(self.label, result, f"checking {python}")
        if lines[1] != __version__:
            raise HostError(self.label, f"has distrun {lines[1]} for {python}, this client is {__version__}; "
                                        f"install distrun=={__version__} there (or the client's version to match)")

    def _start(self, remote: Remote, python: str) -> ServerState:
        host = replace(self.host, python=python)
        result = scheduler_for(self.cluster).start_server(remote, host, self.state_dir, self.config)
        if not result.ok:
            raise CommandFailed(self.label, result, "starting the worker server")
        state = self._read_state(remote)
        if state is None:
            raise HostError(self.label, f"the worker server started but wrote no {self.state_dir}/server.json")
        # For `down`: the server's sweep runs where distrun is, which may be that environment only.
        remote.write_file(f"{self.state_dir}/{_INTERPRETER_FILE}", python.encode())
        return state

    def _keep_history(self, remote: Remote, history: Path) -> str:
        """Copy the host's finished jobs into the client's ``history``; what the row adds about it
        (nothing when no job was new). The copy is a convenience: whatever goes wrong is said on the
        row, and `down` goes on (the allocation released, the cluster forgotten)."""
        self.progress(self.label, "keeping the past jobs' records")
        try:
            kept = keep_host_history(remote, self._interpreter(remote), self.state_dir, self.label, history)
        except HostError as exc:
            return f"; past jobs not all kept on this machine: {exc.reason}"
        except Exception as exc:  # noqa: BLE001 - see above: never the reason `down` fails
            return f"; past jobs not all kept on this machine: {type(exc).__name__}: {exc}"
        return f"; {kept} past job(s) kept on this machine" if kept else ""

    def _interpreter(self, remote: Remote) -> str:
        """The interpreter `up` last started this host's server with (else the file's ``python``)."""
        try:
            recorded = (remote.read_file(f"{self.state_dir}/{_INTERPRETER_FILE}") or "").strip()
        except HostError:
            recorded = ""
        return recorded if recorded and "\n" not in recorded else self.host.python

    def _stop_server(self, remote: Remote, state: ServerState) -> bool:
        """Ask the server to stop and wait until it is gone; False if none answered."""
        try:
            with connect(remote, state, self.label) as client:
                client.call("shutdown")
        except HostError:
            return False
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            if not self._sweep(remote, kill=False)["found"]:
                break
            time.sleep(0.2)
        return True

    def _sweep(self, remote: Remote, *, kill: bool, python: str | None = None) -> dict[str, list[int]]:
        argv = [python or self._interpreter(remote), "-m", "distrun.server", "sweep", "--state-dir", self.state_dir]
        result = remote.run([*argv, "--kill"] if kill else argv)
        if not result.ok:
            raise CommandFailed(self.label, result, "checking for distrun processes")
        try:
            swept = json.loads(result.stdout)
            return {"found": list(swept["found"]), "left": list(swept["left"])}
        except (ValueError, KeyError, TypeError, RecursionError):
            raise CommandFailed(self.label, result, "checking for distrun processes") from None

    def _row(self, status: HostStatus, info: ServerInfo, rtt_ms: float, *, note: str = "") -> HostRow:
        slots, _ = slots_for(self.host, info)
        notes = [note] if note else []
        if self.host.gpus is not None and self.host.gpus > info.gpu_count:
            notes.append(f"the cluster file says gpus: {self.host.gpus}, the host shows {info.gpu_count}")
        message = "; ".join(notes)
        return HostRow(self.label, _roles(self.host), status, message=message, slots=slots, server=info,
                       rtt_ms=rtt_ms)
