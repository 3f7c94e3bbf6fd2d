"""`distrun jobs | attach | logs | cancel`: jobs already running on a cluster's servers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from distrun.cli._app import app, stderr
from distrun.cli.cluster import resolve_cluster
from distrun.cli._run import profile_line, run_job
from distrun.client import ClusterJob
from distrun.client.jobs import cancel_job, collapse_ranks, job_output, list_jobs, pull_job
from distrun.errors import UsageError
from distrun.ui import fmt_ranks

_CLUSTER = typer.Option(None, "--cluster", help="The cluster file; none: this machine's embedded server.")


@app.command()
def jobs(
    cluster_file: Path | None = _CLUSTER,
    json_output: bool = typer.Option(False, "--json", help="One JSON object per job."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """List the jobs the cluster's servers know, newest first."""
    unreachable: list[str] = []
    rows = list_jobs(resolve_cluster(cluster_file), unreachable)
    for host in unreachable:
        stderr.print(f"note: not listed: {host}", markup=False)
    if json_output:
        for row in rows:
            typer.echo(json.dumps(row.to_dict()))
        return
    table = Table(box=box.SIMPLE_HEAD)
    why = any(row.reason or row.failure for row in rows)  # stopped: by whom; failed: the root cause
    for name in ("job", "state", "recipe", "strategy", "replicas", "hosts", "started", *(("why",) if why else ())):
        table.add_column(name, no_wrap=name not in ("hosts", "why"))
    for row in rows:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.started_at))
        replicas = str(row.world_size) if row.world_now is None else f"{row.world_now} of {row.world_size}"
        table.add_row(row.job, row.state, row.recipe, row.strategy, replicas, ", ".join(row.hosts), started,
                      *((row.reason or row.failure or "",) if why else ()))
    Console(highlight=False, width=None if Console().is_terminal else 160).print(table)


@app.command()
def attach(
    job: str = typer.Argument(..., metavar="JOB", help="A job id (`distrun jobs`)."),
    cluster_file: Path | None = _CLUSTER,
    json_output: bool = typer.Option(False, "--json", help="NDJSON events on stdout, a summary last."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Replay a job from its start and follow it; Ctrl-C detaches (the job goes on)."""
    cluster_job = ClusterJob.attach(resolve_cluster(cluster_file), job)
    run_job(cluster_job, json_output=json_output, host_of_rank=cluster_job.host_of_rank)


@app.command()
def logs(
    job: str = typer.Argument(..., metavar="JOB", help="A job id (`distrun jobs`)."),
    cluster_file: Path | None = _CLUSTER,
    rank: int | None = typer.Option(None, "--rank", help="Only this rank's lines."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
    all_lines: bool = typer.Option(False, "--all", help="Do not collapse lines that many ranks printed alike."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Print the output of every rank, kept on the hosts; identical lines collapse to "ranks 0-3: ..."."""
    lines = job_output(resolve_cluster(cluster_file), job, follow=follow)
    chosen = ((host, event) for host, event in lines if rank is None or event.rank == rank)
    if follow or all_lines or rank is not None:
        for host, event in chosen:
            typer.echo(f"[{host} rank {event.rank}] {event.line}")
        return
    for ranks, text in collapse_ranks([(event.rank, event.line) for _host, event in chosen]):
        typer.echo(f"{fmt_ranks(ranks)}: {text}")


@app.command()
def cancel(
    job: str = typer.Argument(..., metavar="JOB", help="A job id (`distrun jobs`)."),
    cluster_file: Path | None = _CLUSTER,
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Cancel a job on every host that runs it."""
    hosts = cancel_job(resolve_cluster(cluster_file), job)
    stderr.print(f"cancelled {job} on {', '.join(hosts)}", markup=False)


@app.command()
def pull(
    job: str = typer.Argument(..., metavar="JOB", help="A job id (`distrun jobs`)."),
    cluster_file: Path | None = _CLUSTER,
    to: Path = typer.Option(Path("distrun-results"), "--to", help="Copy into DIR/<job id>."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Copy a job's newest checkpoint home from the host that wrote it (and its --tensorboard files,
    and every host's --profile traces)."""
    fetched, traces = pull_job(resolve_cluster(cluster_file), job, to / job)
    if fetched is None and not traces:
        raise UsageError(f"job {job} wrote no checkpoint (was --checkpoint-dir given?) and no --profile traces")
    if traces:
        stderr.print(profile_line(len(traces), str(to / job / "profile")), markup=False)
    if fetched is not None:
        typer.echo(str(fetched))
