"""`distrun train RECIPE`: train a recipe on this machine under a strategy."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape  # help is rich markup: "distrun[wandb]" would lose "[wandb]" as a style tag

from distrun.cli._app import app, stderr
from distrun.cli._auto import AUTO, choose, choose_on_cluster, with_measured
from distrun.cli._job_file import job_from_files
from distrun.cli._run import JsonStream, print_json, run_job
from distrun.cli._spec import (
    DEFAULT_GLOBAL_BATCH_SIZE,
    build_spec,
    diloco_alone,
    local_layout,
    recipe_defaults,
    replicas_of,
)
from distrun.cli.cluster import resolve_cluster
from distrun.client import ClusterJob, JobEnvironment, LocalJob, pack
from distrun.client.warm import WarmStart, find_warm_start
from distrun.config import (
    DEFAULT_CPU_REPLICAS,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    DEFAULT_POWERSGD_WARMUP,
    DEFAULT_SYNC_EVERY,
    DEFAULT_KEEP_CHECKPOINTS,
    DEFAULT_PS_PARTITION_MB,
    ClusterSpec,
    JobSpec,
    Role,
    StrategyName,
    inspect_recipe,
    parse_elastic,
    check_trackers,
    parse_profile,
    parse_tracker_uris,
)
from distrun.errors import DistrunError, UsageError
from distrun.protocol import JobSummary


def _filled(params: dict[str, Any]) -> dict[str, Any]:
    """``--print-config``: the defaults the command would choose, filled in (the strategy, the
    recipe's ``defaults`` where nothing set them), as ``build_spec`` chooses them."""
    out = dict(params)
    if out.get("strategy") is None:
        out["strategy"] = default_strategy(out.get("cluster_file") is not None)
    if out["strategy"] == AUTO and out.get("cluster_file") is None:  # the layout auto would choose, to pin
        choice = choose(Path(out["recipe"]), replicas=out.get("replicas"), device=out.get("device", "auto"),
                        global_batch_size=out.get("global_batch_size"), seed=out.get("seed"),
                        recipe_args=tuple(out.get("recipe_args") or ()), given=out,
                        keep=out, approximate=bool(out.get("auto_approximate")))
        for line in choice.lines:
            stderr.print(line, markup=False, soft_wrap=True)
        out.update(choice.flags)
        out["auto_approximate"] = False  # the layout is pinned now: the option is auto's alone
    try:
        info = inspect_recipe(str(Path(out["recipe"]).expanduser()))
    except DistrunError:  # its own error comes when it runs
        info = None
    if info is not None:
        out.update(recipe_defaults(info, **{key: out.get(key) for key in (
            "steps", "epochs", "global_batch_size", "seed", "checkpoint_every")}))
    out["recipe_args"] = list(out.get("recipe_args") or ())
    return out


def _failed_early(exc: BaseException, params: dict[str, Any]) -> None:
    """A bad --config (or cluster file's job:) still ends a --json stream with a failed summary."""
    JsonStream(bool(params.get("json_output"))).failed_before_the_job(
        exc, recipe=params["recipe"], strategy=params.get("strategy"), replicas=params.get("replicas"))


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
@job_from_files(fill=_filled, failed=_failed_early)
def train(
    ctx: typer.Context,
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="The recipe: fit-style, custom loop (main(strategy)) or a plain torchrun script."),
    recipe_args: list[str] = typer.Argument(None, metavar="RECIPE_ARGS", help="Arguments after `--` go to the recipe (sys.argv[1:]).", show_default=False),
    strategy: str | None = typer.Option(None, "--strategy", "-s", help="auto (distrun measures the model, the memory and the links, and chooses the layout: docs/strategies.md#auto) | one-device | mirrored | multi-worker (--cluster: every worker host) | central-storage | parameter-server (alias ps) | sharded (alias fsdp: FSDP2, for models too big for one device) | diloco (replicas sync every --sync-every steps: for slow links). Default: one-device here, multi-worker with --cluster."),
    replicas: int | None = typer.Option(None, "--replicas", "-n", help=f"Processes: default one per GPU, else {DEFAULT_CPU_REPLICAS} on CPU (1 for one-device)."),
    device: str = typer.Option("auto", "--device", help="auto (GPU if any) | cpu | cuda"),
    auto_approximate: bool = typer.Option(False, "--auto-approximate", help="--strategy auto: also race --compression bf16 and diloco against the exact layout, and keep one only where it reached the exact layout's eval loss sooner (needs the recipe's eval_data; docs/strategies.md#auto-approximate)."),
    elastic: str | None = typer.Option(None, "--elastic", metavar="MIN[:MAX]", help="mirrored, diloco (replicas) or multi-worker, diloco on a cluster (worker hosts): a lost replica does not stop the job while MIN remain; it is restarted and rejoins, up to MAX (docs/elastic.md)."),
    sync_batch_norm: bool = typer.Option(False, "--sync-batch-norm/--no-sync-batch-norm", help="mirrored, multi-worker: BatchNorm statistics over the global batch (torch's SyncBatchNorm on CUDA, distrun's on CPU)."),
    embeddings: str = typer.Option("dense", "--embeddings", help="mirrored, multi-worker: dense (embedding tables all-reduced with the model) | ps (tables larger than --ps-partition-mb on the ps tasks, split by rows; the rest DDP; docs/strategies.md#hybrid)."),
    steps: int | None = typer.Option(None, "--steps", help="Train this many global steps in total."),
    epochs: int | None = typer.Option(None, "--epochs", help="Train this many epochs (default: recipe defaults, else 1)."),
    global_batch_size: int | None = typer.Option(None, "--global-batch-size", "-b", help=f"Samples per step over all replicas (default: recipe defaults, else {DEFAULT_GLOBAL_BATCH_SIZE})."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of initial parameters and data order (default 0)."),
    data_workers: int = typer.Option(0, "--data-workers", help="Fit recipes: DataLoader worker processes per rank reading train_data (0: the rank reads it); on a GPU, batches are pinned and copied without blocking."),
    accumulate: int = typer.Option(1, "--accumulate", metavar="N", help="Fit recipes: each replica's share of a global batch in N micro-batches (one forward and backward each), gradients synchronised once, one optimizer step per global batch."),
    eval_every: int | None = typer.Option(None, "--eval-every", metavar="N", help="Fit recipes with eval_data: evaluate every N steps too (every run evaluates at its end, and at each epoch's)."),
    clip_grad_norm: float | None = typer.Option(None, "--clip-grad-norm", metavar="MAX", help="Clip the gradients' global norm to MAX before each optimizer step (every synchronous strategy; over the shards under sharded)."),
    on_nonfinite: str = typer.Option("stop", "--on-nonfinite", help="Fit-style recipes, a NaN or Inf loss: stop (name the step and rank) | skip (drop the update on every replica) | warn."),
    precision: str = typer.Option("fp32", "--precision", help="fp32 | bf16 | fp16: autocast around forward and loss; fp16 adds a loss scaler (docs/precision.md)."),
    compile_model: bool = typer.Option(False, "--compile/--no-compile", help="torch.compile the prepared model (after DDP's wrap); kernels cached per host."),
    compile_mode: str = typer.Option("default", "--compile-mode", help="default | reduce-overhead | max-autotune (with --compile)."),
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="Folder for ckpt-<step>.pt files."),
    checkpoint_every: int | None = typer.Option(None, "--checkpoint-every", help="Write a checkpoint every N steps (always one at the end)."),
    keep_checkpoints: int = typer.Option(DEFAULT_KEEP_CHECKPOINTS, "--keep-checkpoints", help="Keep the newest K checkpoints."),
    resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue from the newest checkpoint in --checkpoint-dir."),
    async_checkpoint: bool = typer.Option(False, "--async-checkpoint/--no-async-checkpoint", help="sharded: write checkpoints in the background (DCP's async_save); a step waits only while the shards are copied."),
    compression: str = typer.Option("none", "--compression", help="mirrored, multi-worker: none | fp16 | bf16 | powersgd[:RANK]: what gradients are all-reduced as (docs/communication.md)."),
    powersgd_warmup: int = typer.Option(DEFAULT_POWERSGD_WARMUP, "--powersgd-warmup", help="--compression powersgd: plain all-reduce steps first."),
    allreduce: str = typer.Option("flat", "--allreduce", help="multi-worker on a cluster: flat (DDP's ring) | hierarchical (inside each host, then across hosts) | auto (time both on this job's buckets, keep the faster)."),
    sync_every: int = typer.Option(DEFAULT_SYNC_EVERY, "--sync-every", metavar="H", help="diloco: inner steps each replica takes alone between syncs (--steps counts inner steps)."),
    outer_lr: float = typer.Option(DEFAULT_OUTER_LR, "--outer-lr", help="diloco: the outer SGD's learning rate on the replicas' mean pseudo-gradient."),
    outer_momentum: float = typer.Option(DEFAULT_OUTER_MOMENTUM, "--outer-momentum", help="diloco: the outer SGD's Nesterov momentum (0: plain SGD, Nesterov off)."),
    sync_dtype: str = typer.Option("fp32", "--sync-dtype", help="diloco: fp32 | bf16 | int8: what pseudo-gradients cross the wire as (bf16 and int8 feed their rounding error into the next sync)."),
    fragments: int = typer.Option(1, "--fragments", metavar="K", help="diloco: streaming DiLoCo: sync the model's units in K fragments, one at a time over the H steps, each exchange overlapping the next step (docs/strategies.md#diloco)."),
    ps_tasks: int | None = typer.Option(None, "--ps-tasks", help="parameter-server and --embeddings ps, without --cluster: ps task processes here (default 1); on a cluster, one per host with role ps."),
    ps_sync: bool = typer.Option(False, "--ps-sync/--no-ps-sync", help="parameter-server: apply the mean of one push from every worker per step (synchronous rounds)."),
    max_staleness: int | None = typer.Option(None, "--max-staleness", help="parameter-server: a worker more than K steps ahead of the slowest waits."),
    ps_partition_mb: float = typer.Option(DEFAULT_PS_PARTITION_MB, "--ps-partition-mb", help="parameter-server: split parameters bigger than this by rows across the ps tasks."),
    shard_within: str = typer.Option("auto", "--shard-within", help="sharded: auto (HSDP on 2+ hosts when the model fits a host) | all (shard over every rank) | host (HSDP: shard inside each host, replicate across hosts)."),
    reshard_after_forward: bool = typer.Option(True, "--reshard-after-forward/--no-reshard-after-forward", help="sharded: free each block's gathered parameters after its forward (less memory), or keep them for backward (less communication)."),
    offload: str = typer.Option("none", "--offload", help="sharded: none | cpu (keep shards and optimizer state in host memory; FSDP's CPUOffloadPolicy)."),
    tp: int = typer.Option(1, "--tp", metavar="N", help="mirrored, multi-worker, sharded: split each replica's layers over N ranks (tensor parallel; the recipe's tp_plan(model), else its MLP pairs); a job runs --replicas x N ranks, a cluster's slots / N replicas (docs/strategies.md#model-parallel)."),
    pp: int = typer.Option(1, "--pp", metavar="P", help="mirrored, multi-worker, sharded: cut each replica's layer chain (an nn.Sequential's children, or the recipe's pp_chain(model)) into P pipeline stages, balanced by parameters; a job runs --replicas x --tp x P ranks, stages across hosts (docs/strategies.md#pipeline-parallel---pp)."),
    pp_schedule: str = typer.Option("1f1b", "--pp-schedule", help="--pp: gpipe | 1f1b | interleaved-1f1b | zero-bubble (two stages a rank, looped) | zbv | dualpipe-v (two stages a rank, as a V)."),
    sequence_parallel: bool = typer.Option(False, "--sequence-parallel/--no-sequence-parallel", help="--tp: also split the activations between the split layers by sequence position (norms, dropout run on a slice; the recipe's tp_plan marks them \"sequence\"): less activation memory per rank (docs/strategies.md#sequence-parallel)."),
    loss_parallel: bool = typer.Option(False, "--loss-parallel/--no-loss-parallel", help="--tp: keep the logits of the plan's \"output\" layer split by class and compute the loss on each rank's slice (torch's loss_parallel): no rank holds whole logits."),
    microbatches: int | None = typer.Option(None, "--microbatches", metavar="M", help="--pp: split each replica's batch into M microbatches (default 2 x P); M must divide it."),
    activation_checkpointing: str = typer.Option("none", "--activation-checkpointing", help="none | full | selective: recompute each block's activations in backward (full), or all but the matmuls' (selective), for less memory (docs/strategies.md#activation-checkpointing)."),
    tensorboard: Path | None = typer.Option(None, "--tensorboard", help=escape("Write TensorBoard event files to DIR (loss, samples/s, learning rate, eval, strategy.log, ps figures); --cluster: they come home to DIR (pip install 'distrun[tensorboard]').")),
    profile: str | None = typer.Option(None, "--profile", metavar="START:END", help="torch.profiler on every rank over these global steps (CPU and CUDA, shapes, memory); traces for Perfetto and TensorBoard come home: --cluster, to the results dir; here, to --checkpoint-dir/profile (else the results dir) (docs/profiling.md)."),
    tracker: list[str] = typer.Option([], "--tracker", help=escape("mlflow | wandb | tensorboard (repeatable): rank 0 logs the run's parameters, per-step metrics and summary there (pip install 'distrun[mlflow]' / 'distrun[wandb]'; docs/tracking.md).")),
    tracker_uri: list[str] = typer.Option([], "--tracker-uri", metavar="[NAME=]URI", help="Where a tracker writes: MLflow's tracking URI (sqlite:///mlflow.db, http://host:5000), W&B's run folder, TensorBoard's log folder; NAME= when several trackers are given."),
    run_name: str | None = typer.Option(None, "--run-name", help="--tracker: the run's name."),
    experiment: str | None = typer.Option(None, "--experiment", help="--tracker: MLflow's experiment, W&B's project."),
    tracker_checkpoint: bool = typer.Option(False, "--tracker-checkpoint/--no-tracker-checkpoint", help="--tracker mlflow|wandb: log the newest checkpoint as an artifact at the end."),
    hang_timeout_s: float | None = typer.Option(None, "--hang-timeout-s", help="Name the stuck rank (and who waits for it) when no rank has stepped for this long."),
    log_interval_s: float = typer.Option(0.25, "--log-interval-s", help="Send each replica's progress at most this often (0: every step)."),
    cluster_file: Path | None = typer.Option(None, "--cluster", help="Train on the hosts of this cluster file (after `distrun up`)."),
    include: list[Path] = typer.Option([], "--include", help="--cluster: also ship this file or folder (inside the recipe's folder)."),
    detach: bool = typer.Option(False, "--detach/--no-detach", help="--cluster: start the job, print its id and return (`distrun attach`)."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="--cluster: after a failure, restart every rank from the newest checkpoint, up to N times."),
    results_dir: Path = typer.Option(Path("distrun-results"), "--results-dir", help="--cluster: the newest checkpoint and the summary come home to DIR/<job id>."),
    fetch: bool = typer.Option(True, "--fetch/--no-fetch", help="--cluster: copy results home when the job ends."),
    requirements: Path | None = typer.Option(None, "--requirements", metavar="FILE", help="--cluster: this job's own packages (pip's format) on top of the cluster's requirements:, built once per host and reused (docs/cluster.md#a-jobs-own-packages---requirements)."),
    allow_skew: bool = typer.Option(False, "--allow-skew/--no-allow-skew", help="--cluster: run even where a host's Python, torch or a package the recipe imports has another version than here (a missing package is still refused)."),
    cold: bool = typer.Option(False, "--cold/--no-cold", help="Without --cluster: start fresh interpreters even when `distrun up` keeps a warm one here."),
    config: Path | None = typer.Option(None, "--config", metavar="FILE", help="The job's options in a YAML file, by section (strategy: {name: mirrored, replicas: 2}); flags given here win over it (docs/cli.md#a-job-in-a-file---config)."),
    print_config: bool = typer.Option(False, "--print-config", help="Print the job as a --config file (defaults filled in, after every override) and exit."),
    json_output: bool = typer.Option(False, "--json", help="No table: one JSON object per line on stdout, a summary last."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> JobSummary | None:
    """Train RECIPE under --strategy, here or on a cluster; switching strategy never changes the recipe."""
    stream = JsonStream(json_output)
    try:
        if strategy is None:  # a cluster means all of it: every worker host
            strategy = default_strategy(cluster_file is not None)
        plan = None
        if auto_approximate and strategy != AUTO:
            raise UsageError(f"--auto-approximate is for --strategy auto. Received: --strategy {strategy}")
        if strategy == AUTO:  # the planner chooses the layout before the job is built
            given = {"tp": tp, "pp": pp, "microbatches": microbatches, "pp_schedule": pp_schedule, "offload": offload,
                     "activation_checkpointing": activation_checkpointing, "accumulate": accumulate,
                     "shard_within": shard_within}
            keep = {"precision": precision, "compile": compile_model, "compile_mode": compile_mode,
                    "compression": compression, "data_workers": data_workers, "clip_grad_norm": clip_grad_norm,
                    "on_nonfinite": on_nonfinite, "steps": steps, "epochs": epochs, "checkpoint_dir": checkpoint_dir,
                    "checkpoint_every": checkpoint_every, "sync_batch_norm": sync_batch_norm,
                    "allreduce": allreduce, "embeddings": embeddings}
            if cluster_file is not None:
                if replicas is not None:
                    raise UsageError("--replicas: on a cluster each host runs its `slots:` (cluster file); set them there")
                choice = choose_on_cluster(resolve_cluster(cluster_file), recipe, device=device,
                                           global_batch_size=global_batch_size, seed=seed,
                                           recipe_args=tuple(recipe_args or ()), include=include, given=given,
                                           environment=JobEnvironment(str(requirements) if requirements else None,
                                                                      allow_skew), keep=keep,
                                           approximate=auto_approximate)
            else:
                choice = choose(recipe, replicas=replicas, device=device, global_batch_size=global_batch_size,
                                seed=seed, recipe_args=tuple(recipe_args or ()), given=given, keep=keep,
                                approximate=auto_approximate)
            for line in choice.lines:
                stderr.print(line, markup=False, soft_wrap=True)
            plan, chosen = choice.plan, dict(choice.flags)
            strategy, replicas, device = chosen.pop("strategy"), chosen.pop("replicas"), chosen.pop("device")
            tp, pp = chosen.get("tp", tp), chosen.get("pp", pp)
            pp_schedule = chosen.get("pp_schedule", pp_schedule)
            microbatches = chosen.get("microbatches", microbatches)
            activation_checkpointing = chosen.get("activation_checkpointing", activation_checkpointing)
            accumulate = chosen.get("accumulate", accumulate)
            shard_within = chosen.get("shard_within", shard_within)
            offload = chosen.get("offload", offload)
            compression = chosen.get("compression", compression)  # --auto-approximate's
            sync_every = chosen.get("sync_every", sync_every)
        observe = observe_flags(profile=profile, trackers=tracker, tracker_uris=tracker_uri, run_name=run_name,
                                experiment=experiment, tracker_checkpoint=tracker_checkpoint, tensorboard=tensorboard,
                                checkpoint_dir=checkpoint_dir, results_dir=results_dir, local=cluster_file is None)
        flags = dict(
            recipe=recipe, recipe_args=tuple(recipe_args or ()), strategy=strategy, device=device,
            steps=steps, epochs=epochs, global_batch_size=global_batch_size, seed=seed, checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints, resume=resume,
            sync_batch_norm=sync_batch_norm, embeddings=embeddings, auto_approximate=auto_approximate, ps_sync=ps_sync,
            max_staleness=max_staleness,
            ps_partition_mb=ps_partition_mb, log_interval_s=log_interval_s, precision=precision,
            compile=compile_model, compile_mode=compile_mode, compression=compression, powersgd_warmup=powersgd_warmup,
            allreduce=allreduce, on_nonfinite=on_nonfinite, reshard_after_forward=reshard_after_forward,
            shard_within=shard_within, offload=offload, clip_grad_norm=clip_grad_norm,
            async_checkpoint=async_checkpoint, data_workers=data_workers, accumulate=accumulate, tp=tp, pp=pp,
            pp_schedule=pp_schedule,
            sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
            microbatches=microbatches or 0,
            activation_checkpointing=activation_checkpointing, sync_every=sync_every, outer_lr=outer_lr,
            outer_momentum=outer_momentum, sync_dtype=sync_dtype, fragments=fragments, eval_every=eval_every,
            **observe,
        )
        if hang_timeout_s is not None and hang_timeout_s <= 0:
            raise UsageError(f"--hang-timeout-s: expected a positive number of seconds. Received: {hang_timeout_s:g}")
        if cluster_file is None:
            cluster_only = [name for name, used in (("--include", include), ("--detach", detach),
                                                     ("--max-restarts", max_restarts),
                                                     ("--requirements", requirements)) if used]
            if cluster_only:
                raise UsageError(f"{cluster_only[0]} is for cluster jobs; it needs --cluster")
            if ps_tasks is None and (StrategyName.parse(strategy) is StrategyName.PARAMETER_SERVER or embeddings == "ps"):
                ps_tasks = 1  # parameter-server and the hybrid's tables need one; more with --ps-tasks
            spec = alone(build_spec(replicas=replicas, ps_tasks=ps_tasks or 0, **flags))
            if elastic is not None:
                low, high = parse_elastic(elastic, spec.strategy.replicas)
                spec = spec.replace(elastic_min=low, elastic_max=high)
            if spec.communication.allreduce == "hierarchical":
                raise UsageError(f"--allreduce {spec.communication.allreduce}: arranges the all-reduce across hosts; "
                                 "it needs --cluster with two or more worker hosts (this machine is one)")
            here = resolve_cluster(None)
            start = WarmStart(None, "--cold") if cold else find_warm_start(here)
            if start.noteworthy:
                stderr.print(f"note: starting cold: {start.reason}", markup=False)
            local_job = LocalJob(spec, hang_timeout_s=hang_timeout_s, starter=start.starter, list_on=here)
            if local_job.listing is not None:  # `distrun up` runs here: the job is one of its jobs
                if json_output:
                    print_json({"type": "job", "job": local_job.job_id, "world_size": spec.world_size,
                                 "hosts": [local_job.listing.host], "bundle_sent_to": []})
                else:
                    stderr.print(f"job {local_job.job_id}: listed on the local server (`distrun jobs`, `logs`, "
                                 "`stacks`, `cancel` reach it)", markup=False)
            return run_job(local_job, json_output=json_output, stream=stream,
                           decorate=(lambda summary: with_measured(plan, summary)) if plan is not None else None)
        if cold:
            raise UsageError("--cold is for local jobs; a cluster's servers always fork from their warm interpreter")
        if replicas is not None:
            raise UsageError("--replicas: on a cluster each host runs its `slots:` (cluster file); set them there")
        if ps_tasks is not None:
            raise UsageError("--ps-tasks: on a cluster every host with role ps runs one ps task; set roles there")
        if max_restarts < 0:
            raise UsageError(f"--max-restarts: expected 0 or more. Received: {max_restarts}")
        return run_cluster_job(resolve_cluster(cluster_file), flags, include, json_output=json_output, detach=detach,
                        results_dir=results_dir if fetch else None, max_restarts=max_restarts,
                        hang_timeout_s=hang_timeout_s, elastic=elastic, stream=stream,
                        environment=JobEnvironment(str(requirements) if requirements else None, allow_skew),
                        decorate=(lambda summary: with_measured(plan, summary)) if plan is not None else None)
    except (DistrunError, KeyboardInterrupt) as exc:  # before the job had a summary of its own
        stream.failed_before_the_job(exc, recipe=recipe, strategy=strategy, replicas=replicas)
        raise


def run_cluster_job(cluster: ClusterSpec, flags: dict[str, Any], include: list[Path], *, json_output: bool,
                    detach: bool, results_dir: Path | None, max_restarts: int = 0,
                    hang_timeout_s: float | None = None, elastic: str | None = None,
                    stream: JsonStream | None = None, environment: JobEnvironment | None = None,
                    decorate: Callable[[JobSummary], JobSummary] | None = None) -> JobSummary | None:
    """Open the training hosts (world size), pack and ship the code, then run like a local job;
    ``decorate``: what the command adds to the summary (``--strategy auto``'s plan)."""
    job = ClusterJob.plan(cluster, StrategyName.parse(str(flags["strategy"])),
                          embeddings_ps=flags.get("embeddings") == "ps")
    try:
        device = str(flags.pop("device"))
        if device == "auto":
            device = "cuda" if job.gpus_everywhere else "cpu"
        per_replica = int(flags.get("tp", 1)) * int(flags.get("pp", 1))
        tp = int(flags.get("tp", 1))
        uneven = [p.host.label for p in job.placements if tp > 1 and p.slots % tp]
        if uneven:
            raise UsageError(f"--tp {tp}: a tensor-parallel group stays inside one host, and {uneven[0]} has "
                             f"{next(p.slots for p in job.placements if p.host.label == uneven[0])} slot(s) in "
                             f"{cluster.source}; give each worker host a multiple of {tp} slots")
        spec = alone(build_spec(replicas=replicas_of(job.replicas, per_replica, cluster.source),
                                ps_tasks=job.ps_tasks, device=device, gpus=job.replicas if job.gpus_everywhere else 0,
                                **flags))
        if spec.communication.allreduce == "hierarchical" and len(job.placements) < 2:
            raise UsageError(f"--allreduce {spec.communication.allreduce}: {cluster.source} trains on one host; it "
                             "arranges the all-reduce across two or more worker hosts")
        if elastic is not None:
            spec = spec.replace(**job.elastic.elastic_range(elastic))
        if elastic is not None and spec.strategy.embeddings == "ps" and spec.strategy.elastic_max > job.replicas:
            # A worker host added to the cluster file would be placed after the ps tasks' ranks and taken
            # for one; the hosts the job starts with leave and rejoin in their own places.
            hosts = sum(Role.PS not in p.host.roles for p in job.placements)
            raise UsageError(f"--elastic {elastic} with --embeddings ps: on a cluster the job keeps the {hosts} "
                             f"worker host(s) it starts with (a host added later is not placed yet); give "
                             f"--elastic MIN:{hosts}")
        if (cluster.slurm is not None and spec.checkpoint.dir and spec.strategy.name.collective
                and not spec.strategy.elastic):
            # The allocation's warning before its time limit: checkpoint at an agreed step, stop (exit 75).
            spec = spec.replace(preemptible=True)
        job.start(spec, pack(Path(spec.recipe), include), detach=detach, max_restarts=max_restarts,
                  hang_timeout_s=hang_timeout_s,
                  debug_dir=((results_dir or Path("distrun-results")) / job.job_id / "debug").resolve(),
                  environment=environment)
    except BaseException:
        job.close()
        raise
    if detach:
        job.close()
        if stream is not None:
            stream.summary_printed = True  # a detached job's stream is its one job line
        if json_output:
            print_json({**_job_line(job), "detached": True})
        else:
            typer.echo(job.job_id)
            stderr.print(f"detached: `distrun attach {job.job_id}`, `distrun logs {job.job_id}`, "
                         f"`distrun cancel {job.job_id}` (with --cluster {cluster.source})", markup=False)
        return
    if not json_output:
        sent = ", ".join(job.bundle_sent_to) or "none (every host had it)"
        ps = f" + {job.ps_tasks} ps task(s)" if job.ps_tasks else ""
        stderr.print(f"job {job.job_id}: {job.replicas} replica(s){ps} on {len(job.placements)} host(s); "
                     f"code sent to: {sent}", markup=False)
    else:
        print_json(_job_line(job))
    fetch = (lambda summary: job.fetch_results(results_dir / job.job_id, summary)) if results_dir else None
    return run_job(job, json_output=json_output, host_of_rank=job.host_of_rank, after=fetch, stream=stream,
                   decorate=decorate)


def _job_line(job: ClusterJob) -> dict[str, Any]:
    """The first line of a cluster job's --json stream: where it runs and where the code went."""
    return {"type": "job", "job": job.job_id, "world_size": job.world_size,
            "hosts": [p.host.label for p in job.placements], "bundle_sent_to": list(job.bundle_sent_to)}


def observe_flags(*, profile: str | None, trackers: list[str], tracker_uris: list[str], run_name: str | None,
                  experiment: str | None, tracker_checkpoint: bool, tensorboard: Path | None,
                  checkpoint_dir: Path | None, results_dir: Path, local: bool) -> dict[str, Any]:
    """The JobSpec fields of ``--profile``, ``--tracker*`` and ``--tensorboard``, by their flat names
    (``JobSpec.of``'s; they live in its ``observe`` section).

    ``--tracker tensorboard`` is ``--tensorboard`` (its URI the folder, default ``./runs``; with
    ``--run-name``, the run's folder under it, as TensorBoard lays runs out), so
    TensorBoard is written by one tap whichever flag asked for it. A local job's traces go to
    ``--checkpoint-dir``/profile, else to the results dir; a cluster job's to each host's job
    folder (the server decides), and come home to the results dir.
    """
    uris = parse_tracker_uris(tracker_uris, trackers)
    check_trackers(tuple(trackers), uris, run_name=run_name, experiment=experiment, log_checkpoint=tracker_checkpoint,
                   checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None)
    if "tensorboard" in trackers:
        board = Path(uris.pop("tensorboard", "runs"))
        if run_name is not None:  # TensorBoard's way: a folder per run under the log folder
            board = board / run_name
        if tensorboard is not None and board.expanduser().resolve() != tensorboard.expanduser().resolve():
            raise UsageError(f"--tensorboard {tensorboard} and --tracker tensorboard ({board}): one folder, please")
        tensorboard = board
    window = parse_profile(profile) if profile is not None else None
    profile_dir = None
    if window is not None and local:
        run = time.strftime("local-%Y%m%d-%H%M%S")
        profile_dir = str(((checkpoint_dir / "profile") if checkpoint_dir else results_dir / run / "profile")
                          .expanduser().resolve())
    return dict(
        tensorboard_dir=str(tensorboard.expanduser().resolve()) if tensorboard else None,
        profile_steps=window, profile_dir=profile_dir,
        trackers=tuple(name for name in trackers if name != "tensorboard"), tracker_uris=uris,
        run_name=run_name, experiment=experiment, tracker_checkpoint=tracker_checkpoint,
    )


def alone(spec: JobSpec) -> JobSpec:
    """diloco with one replica runs as one-device, said in one line (cli/_spec.py's diloco_alone)."""
    spec, note = diloco_alone(spec)
    if note:
        stderr.print(note, markup=False)
    return spec


def default_strategy(on_cluster: bool) -> str:
    """``--strategy`` left out: multi-worker over every worker host on a cluster, one-device here."""
    return StrategyName.MULTI_WORKER.value if on_cluster else StrategyName.ONE_DEVICE.value


__all__ = ["train", "build_spec", "local_layout"]
