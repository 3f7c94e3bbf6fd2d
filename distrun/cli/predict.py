"""`distrun predict RECIPE`: a checkpoint's model over the recipe's predict_data, on every replica.

Keras's ``model.predict`` beside ``fit``: the job is a training job's processes (the same
placement flags, strategies, live view, ``--json`` stream and one-line errors as ``train``),
told by ``config/_predict.PredictSpec`` to load a checkpoint and predict instead of fitting
(``runtime/_predict.py``). Rank 0 writes one ``torch.save`` file: ``{"outputs": rows}``, row i
the output of ``predict_data``'s sample i. With ``--cluster`` the job runs on the cluster's hosts
(``client/_cluster_predict``): rank 0 writes in its host's job folder and the file comes home.
"""

from __future__ import annotations

from pathlib import Path

import typer

from distrun.cli._app import app, stderr
from distrun.cli._run import JsonStream, print_json, run_job
from distrun.cli._spec import build_spec, replicas_of
from distrun.cli.cluster import resolve_cluster
from distrun.cli.train import alone
from distrun.client import LocalJob, pack
from distrun.client._cluster_predict import PredictJob
from distrun.client._results import CHECKPOINT_NAME
from distrun.client.warm import WarmStart, find_warm_start
from distrun.config import ClusterSpec, PredictSpec, RecipeKind, StrategyName, inspect_recipe
from distrun.errors import CheckpointError, DistrunError, RecipeError, UsageError
from distrun.protocol import JobSummary


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
def predict(
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="A fit-style recipe with predict_data(ctx) (and, optionally, predict_step(model, batch))."),
    recipe_args: list[str] = typer.Argument(None, metavar="RECIPE_ARGS", help="Arguments after `--` go to the recipe (sys.argv[1:]).", show_default=False),
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="Predict with the newest checkpoint in this folder (plain or sharded); --cluster: the folder on the hosts, which each training host must see.", rich_help_panel="Checkpoint and predictions"),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", metavar="PATH", help="Predict with this checkpoint (a ckpt-<step>.pt file or ckpt-<step>/ folder) instead of the newest; --cluster: one on this machine is shipped to the hosts, else it is a path on them.", rich_help_panel="Checkpoint and predictions"),
    output: Path = typer.Option(..., "--output", "-o", metavar="FILE", help="Where rank 0 writes {\"outputs\": rows} with torch.save: row i is sample i's output (--cluster: the file comes home here).", rich_help_panel="Checkpoint and predictions"),
    strategy: str | None = typer.Option(None, "--strategy", "-s", help="one-device | mirrored | central-storage | sharded | diloco | multi-worker (--cluster: every worker host): how the model is laid out over the replicas (any checkpoint loads into any of them). Default: one-device here, multi-worker with --cluster.", rich_help_panel="Placement"),
    replicas: int | None = typer.Option(None, "--replicas", "-n", help="Processes: default one per GPU, else 2 on CPU (1 for one-device).", rich_help_panel="Placement"),
    device: str = typer.Option("auto", "--device", help="auto (GPU if any) | cpu | cuda", rich_help_panel="Placement"),
    global_batch_size: int | None = typer.Option(None, "--global-batch-size", "-b", help="Samples per forward over all replicas (default: recipe defaults, else 64).", rich_help_panel="Placement"),
    tp: int = typer.Option(1, "--tp", metavar="N", help="Split each replica's layers over N ranks (tensor parallel), as `train --tp`.", rich_help_panel="Placement"),
    pp: int = typer.Option(1, "--pp", metavar="P", help="Cut each replica's layer chain into P pipeline stages, as `train --pp`.", rich_help_panel="Placement"),
    log_interval_s: float = typer.Option(0.25, "--log-interval-s", help="Send each replica's progress at most this often (0: every batch).", rich_help_panel="Output"),
    cluster_file: Path | None = typer.Option(None, "--cluster", help="Predict on the hosts of this cluster file (after `distrun up`): --checkpoint-dir is the folder on the hosts, a --checkpoint here is shipped to them, and --output comes home.", rich_help_panel="Where"),
    cold: bool = typer.Option(False, "--cold/--no-cold", help="Start fresh interpreters even when `distrun up` keeps a warm one here.", rich_help_panel="Where"),
    json_output: bool = typer.Option(False, "--json", help="No table: one JSON object per line on stdout, a summary last.", rich_help_panel="Output"),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks.", rich_help_panel="Output"),
) -> JobSummary | None:
    """Run a checkpoint's model over RECIPE's predict_data on every replica; write the outputs to FILE, in order."""
    stream = JsonStream(json_output)
    try:
        if strategy is None:  # a cluster means all of it: every worker host, as `train --cluster`
            strategy = (StrategyName.MULTI_WORKER if cluster_file is not None else StrategyName.ONE_DEVICE).value
        name = StrategyName.parse(strategy)
        if name is StrategyName.PARAMETER_SERVER or (name is StrategyName.MULTI_WORKER and cluster_file is None):
            where = "on a cluster with multi-worker, " if cluster_file is not None else "here with "
            raise UsageError(f"distrun predict --strategy {strategy}: predict runs {where}one-device, mirrored, "
                             "central-storage, sharded or diloco" + ("" if cluster_file is not None else
                                                                     " (multi-worker with --cluster)"))
        _check_recipe(recipe)
        target = output.expanduser().resolve()
        if not target.parent.is_dir():
            raise UsageError(f"--output {output}: {target.parent} is not a folder")
        if target.is_dir():
            raise UsageError(f"--output {output}: a folder; name the file to write")
        flags = dict(recipe=recipe, recipe_args=tuple(recipe_args or ()), strategy=strategy,
                     global_batch_size=global_batch_size, checkpoint_dir=checkpoint_dir, tp=tp, pp=pp,
                     log_interval_s=log_interval_s)
        if cluster_file is not None:
            if replicas is not None:
                raise UsageError("--replicas: on a cluster each host runs its `slots:` (cluster file); set them there")
            if cold:
                raise UsageError("--cold is for local jobs; a cluster's servers always fork from their warm interpreter")
            summary = _on_cluster(resolve_cluster(cluster_file), flags, device=device, target=target,
                                  checkpoint=checkpoint, json_output=json_output, stream=stream)
        else:
            job = PredictSpec(output=str(target), checkpoint=_check_checkpoint(checkpoint_dir, checkpoint))
            spec = alone(build_spec(replicas=replicas, device=device, extra_env=job.to_env(), **_training_none(),
                                    **flags))
            here = resolve_cluster(None)
            start = WarmStart(None, "--cold") if cold else find_warm_start(here)
            if start.noteworthy:
                stderr.print(f"note: starting cold: {start.reason}", markup=False)
            summary = run_job(LocalJob(spec, starter=start.starter, list_on=here), json_output=json_output,
                              stream=stream)
    except (DistrunError, KeyboardInterrupt) as exc:  # before the job had a summary of its own
        stream.failed_before_the_job(exc, recipe=recipe, strategy=strategy, replicas=replicas)
        raise
    if not json_output:
        stderr.print(f"predictions: {target}", markup=False)
    return summary


def _training_none() -> dict[str, None]:
    """The training flags a predict job leaves unset."""
    return dict(steps=None, epochs=None, seed=None, checkpoint_every=None)


def _on_cluster(cluster: ClusterSpec, flags: dict, *, device: str, target: Path, checkpoint: Path | None,
                json_output: bool, stream: JsonStream) -> JobSummary | None:
    """Plan the job on the cluster's training hosts, ship a checkpoint given here, start, follow;
    the outputs come home to ``target`` as part of the job's outcome (``client/_cluster_predict``)."""
    host_path, ship = _cluster_checkpoint(flags["checkpoint_dir"], checkpoint)
    job = PredictJob.plan(cluster, StrategyName.parse(str(flags["strategy"])))
    try:
        if device == "auto":
            device = "cuda" if job.gpus_everywhere else "cpu"
        tp, pp = int(flags["tp"]), int(flags["pp"])
        uneven = next((p for p in job.placements if tp > 1 and p.slots % tp), None)
        if uneven is not None:
            raise UsageError(f"--tp {tp}: a tensor-parallel group stays inside one host, and {uneven.host.label} has "
                             f"{uneven.slots} slot(s) in {cluster.source}; give each worker host a multiple of {tp} slots")
        job.place(target, host_path, ship)
        spec = alone(build_spec(replicas=replicas_of(job.replicas, tp * pp, cluster.source), device=device,
                                gpus=job.replicas if job.gpus_everywhere else 0, extra_env=job.predict_env(),
                                **_training_none(), **flags))
        job.start(spec, pack(Path(spec.recipe)))
    except BaseException:
        job.close()
        raise
    if json_output:
        print_json({"type": "job", "job": job.job_id, "world_size": job.world_size,
                    "hosts": [p.host.label for p in job.placements], "bundle_sent_to": list(job.bundle_sent_to)})
    else:
        sent = ", ".join(job.bundle_sent_to) or "none (every host had it)"
        shipped = f"; checkpoint {ship} shipped to every host" if ship is not None else ""
        stderr.print(f"job {job.job_id}: {job.replicas} replica(s) on {len(job.placements)} host(s); code sent to: "
                     f"{sent}{shipped}", markup=False)
    return run_job(job, json_output=json_output, host_of_rank=job.host_of_rank, stream=stream)


def _cluster_checkpoint(checkpoint_dir: Path | None, checkpoint: Path | None) -> tuple[str | None, Path | None]:
    """(a checkpoint path on the hosts, a checkpoint here to ship). ``--checkpoint`` that exists here
    is shipped; one that does not is a path on the hosts. ``--checkpoint-dir`` is a folder on the
    hosts (resolved as `train --cluster` resolves it): nothing here is checked."""
    if checkpoint is not None:
        path = checkpoint.expanduser().resolve()
        return (None, path) if path.exists() else (str(path), None)
    if checkpoint_dir is None:
        raise UsageError("distrun predict needs --checkpoint-dir DIR (the newest checkpoint in it) or --checkpoint PATH")
    return None, None


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
