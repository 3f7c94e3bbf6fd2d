"""`distrun up | status | doctor | down [CLUSTER]`: worker servers on every host of a cluster file.

Without a cluster file these act on the embedded default: one server on this
machine, started as a local process (no SSH), in ``$DISTRUN_HOME`` (default
``~/.distrun``). The server code is the same.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from distrun.cli._app import app, stderr
from distrun.client import cluster_down, cluster_status, cluster_up
from distrun.client.brought_up import forget, remember
from distrun.client.history import history_dir, note_kept
from distrun.client.doctor import doctor_exit_code, run_doctor
from distrun.config import ClusterSpec, load_cluster, local_cluster
from distrun.protocol.cluster import ClusterReport
from distrun.scheduler import resolve
from distrun.ui import render_cluster
from distrun.ui.cluster import render_doctor

_CLUSTER_HELP = "The cluster file (YAML, docs/cluster.md); none: this machine, no SSH."


def distrun_home() -> str:
    """``$DISTRUN_HOME`` (``~/.distrun``): the local server's state, and the clusters `up` brought up."""
    return os.environ.get("DISTRUN_HOME", "~/.distrun")


def load_cluster_file(path: Path | None) -> ClusterSpec:
    """The cluster file as written (a Slurm cluster's hosts not known yet), or the embedded default."""
    if path is not None:
        return load_cluster(path)
    return local_cluster(workdir=distrun_home(), python=sys.executable)


def resolve_cluster(path: Path | None) -> ClusterSpec:
    """The cluster with its hosts known: a Slurm cluster's are its allocation's nodes (`up` asks for one)."""
    return resolve(load_cluster_file(path))


class _Stages:
    """A transient per-host "what is it doing now" table on stderr while a command runs.

    Without a terminal (a CI log, a batch job's output) only a scheduler's stages are
    printed, one line each time they change: a Slurm request can wait for minutes, and the
    reason it waits (squeue's) belongs in the log.
    """

    def __init__(self, cluster: ClusterSpec, enabled: bool) -> None:
        self._stages = {host.label: "waiting" for host in cluster.hosts}
        self._lock = threading.Lock()
        self._live = Live(self._render(), console=stderr, transient=True, refresh_per_second=8) if enabled else None

    def _render(self) -> Table:
        table = Table.grid(padding=(0, 2))
        for host, stage in self._stages.items():
            table.add_row(host, f"[dim]{stage}[/dim]")
        return table

    def __call__(self, host: str, stage: str) -> None:
        with self._lock:
            changed = self._stages.get(host) != stage
            self._stages[host] = stage
            if self._live is not None:
                self._live.update(self._render())
            elif changed and host.startswith("slurm"):
                stderr.print(f"{host}: {stage}", markup=False, highlight=False)

    def __enter__(self) -> _Stages:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()


def _finish(report: ClusterReport, json_output: bool) -> None:
    if json_output:
        typer.echo(json.dumps(report.to_dict()))
    else:
        console = Console(highlight=False)
        if not console.is_terminal:
            console = Console(highlight=False, width=160)  # piped: do not squeeze the table into 80 columns
        console.print(render_cluster(report))
    if not report.ok:
        bad = report.failed_rows
        names = ", ".join(f"{row.host} ({row.status.value})" for row in bad)
        stderr.print(f"error: {len(bad)} of {len(report.rows)} host(s) not {_WANTED[report.command]}: {names}",
                     markup=False)
        raise typer.Exit(report.exit_code)


_WANTED = {"up": "up", "status": "up", "down": "clean"}


def _run(cluster_file: Path | None, json_output: bool,
         command: Callable[..., ClusterReport], **kwargs: object) -> None:
    cluster = load_cluster_file(cluster_file)  # the command resolves it: `up` may ask Slurm for hosts
    with _Stages(cluster, enabled=not json_output and stderr.is_terminal) as stages:
        report = command(cluster, progress=stages, **kwargs)
    if cluster_file is not None:
        _note(cluster_file, report)
    _finish(report, json_output)


def _note(cluster_file: Path, report: ClusterReport) -> None:
    """Record the clusters up on this machine for `distrun dashboard` (a healthy `up` in, a clean `down`
    out, its kept history said whose it is)."""
    try:
        if report.command == "up" and any(row.status.healthy for row in report.rows):
            remember(distrun_home(), cluster_file, report.cluster)
        elif report.command == "down":
            kept = history_dir(distrun_home(), cluster_file, report.cluster)
            if kept.is_dir():
                note_kept(kept, report.cluster, cluster_file)
            if report.ok:
                forget(distrun_home(), cluster_file)
    except OSError as exc:  # the record is a convenience: the cluster is up (or down) all the same
        stderr.print(f"warning: cannot record the cluster in {distrun_home()}: {exc}", markup=False)


@app.command()
def up(
    cluster_file: Path | None = typer.Argument(None, metavar="[CLUSTER]", help=_CLUSTER_HELP, show_default=False),
    setup: bool = typer.Option(True, "--setup/--no-setup", help="Run the file's setup: commands before starting a server."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Start a worker server on every host (SSH, or a Slurm allocation's nodes); healthy servers are kept, dead or stale ones replaced."""
    # SIGTERM or a closed terminal while a Slurm request is pending: withdraw it, as Ctrl-C does.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    _run(cluster_file, json_output, cluster_up, run_setup=setup)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@app.command()
def status(
    cluster_file: Path | None = typer.Argument(None, metavar="[CLUSTER]", help=_CLUSTER_HELP, show_default=False),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Ask every host's server how it is (round trip, load, memory, jobs); exit non-zero if any is not up."""
    _run(cluster_file, json_output, cluster_status)


@app.command()
def doctor(
    cluster_file: Path | None = typer.Argument(None, metavar="[CLUSTER]", help=_CLUSTER_HELP, show_default=False),
    links: bool = typer.Option(False, "--links", help="Also measure every host pair's link (raw TCP, one pair at a time, as `bench allreduce` does): a short job."),
    json_output: bool = typer.Option(False, "--json", help="One JSON object per host (and per link) instead of the table."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """What makes or breaks a job on each host: versions, CUDA/NCCL, disk, clock, the route and port to the chief.

    Exit 0 when every host can run a job (warnings allowed), 6 when one cannot (docs/cluster.md).
    """
    cluster = resolve_cluster(cluster_file)
    rows = run_doctor(cluster)
    code = doctor_exit_code(rows)
    measured = []
    if links and code == 0 and cluster_file is not None:  # a job runs only where every host can run one
        from distrun.bench.allreduce import run_allreduce
        from distrun.client.cluster_job import training_hosts
        from distrun.config import StrategyName

        labels = [host.label for host in training_hosts(cluster, StrategyName.MULTI_WORKER)]  # the job's host order
        measured = [{"from": labels[link["from_host"]], "to": labels[link["to_host"]], "MBps": link["MBps"]}
                    for link in run_allreduce(cluster=cluster_file, sizes_mb=(), link_s=1.0)["links"]]
    if json_output:
        for row in rows:
            typer.echo(json.dumps(row.to_dict()))
        for link in measured:
            typer.echo(json.dumps({"type": "link", **link}))
    else:
        Console(highlight=False, width=None if Console().is_terminal else 200).print(
            render_doctor(cluster.name, rows, measured))
    raise typer.Exit(code)


@app.command()
def down(
    cluster_file: Path | None = typer.Argument(None, metavar="[CLUSTER]", help=_CLUSTER_HELP, show_default=False),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Stop every job and server, then check that no process of distrun's is left on any host; each host's finished jobs are kept on this machine for `distrun dashboard`."""
    _run(cluster_file, json_output, cluster_down, history_home=distrun_home())
