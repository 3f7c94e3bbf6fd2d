"""`distrun bench WORKLOAD`: benchmarks that print ratios against the alternative."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from distrun.bench.overhead import run_overhead
from distrun.bench.ttfs import run_ttfs
from distrun.cli._app import app, stderr
from distrun.errors import Interrupted, UsageError
from distrun.ui.bench import render_overhead, render_ttfs

_PLANNED = {"resnet50", "resnet18", "mlp"}


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    workload: str = typer.Argument(..., help="overhead | ttfs (built); resnet50 | resnet18 | mlp (planned, issue 6)"),
    cluster_file: Path | None = typer.Option(None, "--cluster", help="ttfs: the (running) cluster to measure."),
    replicas: int = typer.Option(2, "--replicas", "-n", help="Processes for each contender."),
    steps: int = typer.Option(200, "--steps", help="Training steps per run."),
    global_batch_size: int = typer.Option(256, "--global-batch-size", "-b"),
    repeats: int = typer.Option(3, "--repeats", help="Runs per contender; the median is reported."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Measure distrun against the alternative, in one run (docs/performance.md)."""
    if workload in _PLANNED:
        raise UsageError(f"`distrun bench {workload}` is not built yet (planned: scaling report, issue 6)")
    if workload == "ttfs":
        if cluster_file is None:
            raise UsageError("bench ttfs: --cluster FILE is required (a cluster after `distrun up`)")
        try:
            ttfs = run_ttfs(cluster=cluster_file, repeats=repeats,
                            progress=lambda msg: stderr.print(f"[bench] {msg}", markup=False) if not json_output else None)
        except KeyboardInterrupt:
            raise Interrupted("interrupted: benchmark stopped") from None
        if json_output:
            typer.echo(json.dumps(ttfs.to_dict()))
        else:
            Console(highlight=False).print(render_ttfs(ttfs.to_dict()))
        return
    if workload != "overhead":
        raise UsageError(f"bench: unknown workload {workload!r}; built: overhead, ttfs")
    if ctx.args:
        raise UsageError(f"bench overhead: unexpected arguments {' '.join(ctx.args)}")
    for name, value in (("--replicas", replicas), ("--steps", steps), ("--repeats", repeats), ("--global-batch-size", global_batch_size)):
        if value < 1:
            raise UsageError(f"{name}: expected a positive whole number. Received: {value}")
    if steps < 2:
        raise UsageError("--steps: at least 2 (the first step is warm-up and not timed)")
    if global_batch_size % replicas:
        raise UsageError(f"--global-batch-size {global_batch_size} is not divisible by {replicas} replicas")
    try:
        report = run_overhead(
            replicas=replicas, steps=steps, global_batch_size=global_batch_size, repeats=repeats,
            progress=lambda msg: stderr.print(f"[bench] {msg}", markup=False) if not json_output else None,
        ).to_dict()
    except KeyboardInterrupt:  # the contenders share our process group and got the SIGINT too
        raise Interrupted("interrupted: benchmark stopped") from None
    if json_output:
        typer.echo(json.dumps(report))
    else:
        Console(highlight=False).print(render_overhead(report))
