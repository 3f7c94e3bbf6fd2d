"""`distrun plan RECIPE`: what ``--strategy auto`` would choose, and why, without training.

The same probe, budget and decision as ``train --strategy auto`` (cli/_auto.py), printed as the
block the job prints before step 1 (or, with ``--json``, the summary's ``plan`` object), so a
person can read the measured inputs and pin the layout.
"""

from __future__ import annotations

from pathlib import Path

import typer

from distrun.cli._app import app, stderr
from distrun.cli._auto import choose, choose_on_cluster
from distrun.cli.cluster import resolve_cluster
from distrun.cli._run import print_json
from distrun.errors import UsageError


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
def plan(
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="A fit-style recipe (a plain script or a custom loop can only be placed)."),
    recipe_args: list[str] = typer.Argument(None, metavar="RECIPE_ARGS", help="Arguments after `--` go to the recipe (sys.argv[1:]).", show_default=False),
    replicas: int | None = typer.Option(None, "--replicas", "-n", help="Ranks the job gets: default one per GPU, else 2 on CPU."),
    device: str = typer.Option("auto", "--device", help="auto (GPU if any) | cpu | cuda"),
    global_batch_size: int | None = typer.Option(None, "--global-batch-size", "-b", help="Samples per step over all replicas (default: recipe defaults, else 64); auto never changes it."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the probed model's parameters (default: the recipe's, else 0)."),
    cluster_file: Path | None = typer.Option(None, "--cluster", help="Probe on this cluster's worker hosts and slots (a short job there: the model on their devices, their memory, the links between them) and lay the job out over them."),
    trials: bool = typer.Option(True, "--trials/--no-trials", help="Run the layouts the cost model cannot tell apart for a few steps each and keep the faster, as train --strategy auto does (--no-trials: the model's decision alone, no training)."),
    steps: int | None = typer.Option(None, "--steps", help="The job's steps (default: the recipe's): --auto-approximate's diloco syncs at least 4 times in them."),
    auto_approximate: bool = typer.Option(False, "--auto-approximate", help="Also race --compression bf16 and diloco against the exact layout, as train --strategy auto --auto-approximate does (needs the recipe's eval_data)."),
    json_output: bool = typer.Option(False, "--json", help="Print the plan as one JSON object (the --json summary's `plan`)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Probe RECIPE on this machine and print the layout --strategy auto would choose, with its runners-up."""
    if cluster_file is not None:
        if replicas is not None:
            raise UsageError("--replicas: on a cluster each host runs its `slots:` (cluster file); set them there")
        choice = choose_on_cluster(resolve_cluster(cluster_file), recipe, device=device,
                                   global_batch_size=global_batch_size, seed=seed, recipe_args=tuple(recipe_args or ()),
                                   trials=trials, approximate=auto_approximate, keep={"steps": steps})
    else:
        choice = choose(recipe, replicas=replicas, device=device, global_batch_size=global_batch_size, seed=seed,
                        recipe_args=tuple(recipe_args or ()), trials=trials, approximate=auto_approximate,
                        keep={"steps": steps})
    if json_output:
        print_json({"type": "plan", **(choice.plan.summary_object(None, None) if choice.plan else
                                       {"chosen": {"strategy": {"name": choice.flags["strategy"],
                                                                "replicas": choice.flags["replicas"]}},
                                        "placed_only": choice.lines[0]})})
        return
    for line in choice.lines:
        stderr.print(line, markup=False, soft_wrap=True)
