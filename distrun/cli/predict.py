"""`distrun predict RECIPE`: a checkpoint's model over the recipe's predict_data, on every replica.

Keras's ``model.predict`` beside ``fit``: the job is a training job's processes (the same
placement flags, strategies, live view, ``--json`` stream and one-line errors as ``train``),
told by ``config/_predict.PredictSpec`` to load a checkpoint and predict instead of fitting
(``runtime/_predict.py``). Rank 0 writes one ``torch.save`` file: ``{"outputs": rows}``, row i
the output of ``predict_data``'s sample i.
"""

from __future__ import annotations

from pathlib import Path

import typer

from distrun.cli._app import app, stderr
from distrun.cli._run import JsonStream, run_job
from distrun.cli._spec import build_spec
from distrun.cli.cluster import resolve_cluster
from distrun.cli.train import alone
from distrun.client import LocalJob
from distrun.client._results import CHECKPOINT_NAME
from distrun.client.warm import WarmStart, find_warm_start
from distrun.config import PredictSpec, RecipeKind, StrategyName, inspect_recipe
from distrun.errors import CheckpointError, DistrunError, RecipeError, UsageError
from distrun.protocol import JobSummary


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
def predict(
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="A fit-style recipe with predict_data(ctx) (and, optionally, predict_step(model, batch))."),
    recipe_args: list[str] = typer.Argument(None, metavar="RECIPE_ARGS", help="Arguments after `--` go to the recipe (sys.argv[1:]).", show_default=False),
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="Predict with the newest checkpoint in this folder (plain or sharded).", rich_help_panel="Checkpoint and predictions"),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", metavar="PATH", help="Predict with this checkpoint (a ckpt-<step>.pt file or ckpt-<step>/ folder) instead of the newest.", rich_help_panel="Checkpoint and predictions"),
    output: Path = typer.Option(..., "--output", "-o", metavar="FILE", help="Where rank 0 writes {\"outputs\": rows} with torch.save: row i is sample i's output.", rich_help_panel="Checkpoint and predictions"),
    strategy: str = typer.Option("one-device", "--strategy", "-s", help="one-device | mirrored | central-storage | sharded | diloco: how the model is laid out over the replicas (any checkpoint loads into any of them).", rich_help_panel="Placement"),
    replicas: int | None = typer.Option(None, "--replicas", "-n", help="Processes: default one per GPU, else 2 on CPU (1 for one-device).", rich_help_panel="Placement"),
    device: str = typer.Option("auto", "--device", help="auto (GPU if any) | cpu | cuda", rich_help_panel="Placement"),
    global_batch_size: int | None = typer.Option(None, "--global-batch-size", "-b", help="Samples per forward over all replicas (default: recipe defaults, else 64).", rich_help_panel="Placement"),
    tp: int = typer.Option(1, "--tp", metavar="N", help="Split each replica's layers over N ranks (tensor parallel), as `train --tp`.", rich_help_panel="Placement"),
    pp: int = typer.Option(1, "--pp", metavar="P", help="Cut each replica's layer chain into P pipeline stages, as `train --pp`.", rich_help_panel="Placement"),
    log_interval_s: float = typer.Option(0.25, "--log-interval-s", help="Send each replica's progress at most this often (0: every batch).", rich_help_panel="Output"),
    cluster_file: Path | None = typer.Option(None, "--cluster", help="Not yet: predict runs on this machine.", rich_help_panel="Where"),
    cold: bool = typer.Option(False, "--cold/--no-cold", help="Start fresh interpreters even when `distrun up` keeps a warm one here.", rich_help_panel="Where"),
    json_output: bool = typer.Option(False, "--json", help="No table: one JSON object per line on stdout, a summary last.", rich_help_panel="Output"),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks.", rich_help_panel="Output"),
) -> JobSummary | None:
    """Run a checkpoint's model over RECIPE's predict_data on every replica; write the outputs to FILE, in order."""
    stream = JsonStream(json_output)
    try:
        if cluster_file is not None:
            raise UsageError("distrun predict --cluster: not supported yet; predict on this machine (copy the "
                             "checkpoint home with `distrun pull`)")
        if StrategyName.parse(strategy) in (StrategyName.PARAMETER_SERVER, StrategyName.MULTI_WORKER):
            raise UsageError(f"distrun predict --strategy {strategy}: predict runs here with one-device, mirrored, "
                             "central-storage, sharded or diloco")
        _check_recipe(recipe)
        spec_checkpoint = _check_checkpoint(checkpoint_dir, checkpoint)
        target = output.expanduser().resolve()
        if not target.parent.is_dir():
            raise UsageError(f"--output {output}: {target.parent} is not a folder")
        if target.is_dir():
            raise UsageError(f"--output {output}: a folder; name the file to write")
        job = PredictSpec(output=str(target), checkpoint=spec_checkpoint)
        spec = alone(build_spec(recipe=recipe, recipe_args=tuple(recipe_args or ()), strategy=strategy,
                                device=device, replicas=replicas, steps=None, epochs=None,
                                global_batch_size=global_batch_size, seed=None, checkpoint_dir=checkpoint_dir,
                                checkpoint_every=None, tp=tp, pp=pp, log_interval_s=log_interval_s,
                                extra_env=job.to_env()))
        here = resolve_cluster(None)
        start = WarmStart(None, "--cold") if cold else find_warm_start(here)
        if start.noteworthy:
            stderr.print(f"note: starting cold: {start.reason}", markup=False)
        summary = run_job(LocalJob(spec, starter=start.starter, list_on=here), json_output=json_output, stream=stream)
    except (DistrunError, KeyboardInterrupt) as exc:  # before the job had a summary of its own
        stream.failed_before_the_job(exc, recipe=recipe, strategy=strategy, replicas=replicas)
        raise
    if not json_output:
        stderr.print(f"predictions: {target}", markup=False)
    return summary


def _check_recipe(recipe: Path) -> None:
    """A fit-style recipe with ``predict_data``: said before any rank starts."""
    path = recipe.expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"{recipe}: recipe not found")
    info = inspect_recipe(str(path))
    if info.kind is not RecipeKind.FIT:
        raise RecipeError(f"{recipe}: distrun predict runs fit-style recipes (model(), ...); this one is a "
                          f"{info.kind.value}")
    if "predict_data" not in info.functions:
        raise RecipeError(f"{recipe}: distrun predict needs predict_data(ctx) in the recipe (a map-style dataset "
                          "of the samples to predict, in order)")


def _check_checkpoint(checkpoint_dir: Path | None, checkpoint: Path | None) -> str | None:
    """Where the checkpoint is (names only: the ranks read it); ``--checkpoint``'s absolute path."""
    if checkpoint is not None:
        path = checkpoint.expanduser().resolve()
        if not path.exists():
            raise CheckpointError(f"--checkpoint {checkpoint}: no such file or folder")
        return str(path)
    if checkpoint_dir is None:
        raise UsageError("distrun predict needs --checkpoint-dir DIR (the newest checkpoint in it) or --checkpoint PATH")
    folder = checkpoint_dir.expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"--checkpoint-dir {checkpoint_dir}: {'not a folder' if folder.exists() else 'no such folder'}")
    if not any(CHECKPOINT_NAME.match(entry.name) for entry in folder.iterdir()):
        raise CheckpointError(f"--checkpoint-dir {checkpoint_dir}: no checkpoint to predict with (expected "
                              "ckpt-<step>.pt or ckpt-<step>/)")
    return None
