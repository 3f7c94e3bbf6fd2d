"""`distrun stacks`: every rank's Python stack now, from every host, same stacks collapsed."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from distrun.cli._app import app
from distrun.cli.cluster import resolve_cluster
from distrun.client.diagnose import cluster_stacks, running_job
from distrun.protocol import event_to_dict
from distrun.ui import render_diagnosis


@app.command()
def stacks(
    job: str | None = typer.Argument(None, metavar="JOB", help="A job id (`distrun jobs`); none: the one running."),
    cluster_file: Path | None = typer.Option(None, "--cluster", help="The cluster file; none: this machine's embedded server."),
    native: bool = typer.Option(False, "--native", help="C/C++ frames too (py-spy --native): where a rank waits inside torch."),
    flight_recorder: Path | None = typer.Option(None, "--flight-recorder", metavar="DIR",
                                                help="Also dump every rank's Flight Recorder into DIR and show each rank's last collective."),
    json_output: bool = typer.Option(False, "--json", help="One JSON object: every rank's frames and last collective."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Print every rank's stack (py-spy); ranks stopped at the same frames print as one entry."""
    cluster = resolve_cluster(cluster_file)
    job_id = job or running_job(cluster)
    dest = flight_recorder.expanduser().resolve() / job_id if flight_recorder else None
    found = cluster_stacks(cluster, job_id, native=native, dest=dest)
    if json_output:
        typer.echo(json.dumps({**event_to_dict(found), "job": job_id}))
        return
    Console(highlight=False, width=None if Console().is_terminal else 200).print(render_diagnosis(found))
