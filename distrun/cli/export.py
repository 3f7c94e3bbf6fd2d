"""`distrun export k8s | slurm CLUSTER RECIPE`: the same job as Kubernetes manifests (docs/kubernetes.md)
or as an sbatch script (docs/slurm.md), for users who submit jobs themselves."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from distrun.cli._app import app, stderr
from distrun.cli._spec import build_spec
from distrun.client import pack
from distrun.client.cluster_job import training_hosts
from distrun.client._hosts import ps_hosts
from distrun.client.k8s import K8sJob, job_name, manifests, pod_gpus, write
from distrun.client.slurm_batch import SlurmBatch, sbatch_script
from distrun.config import RecipeKind, Role, StrategyName, inspect_recipe, load_cluster
from distrun.errors import UsageError

export_app = typer.Typer(help="Describe a job for another scheduler.", no_args_is_help=True)
app.add_typer(export_app, name="export")

# The flags every export shares, as `distrun train` spells them.
_RECIPE_ARGS = typer.Argument(None, metavar="RECIPE_ARGS", help="Arguments after `--` go to the recipe.",
                              show_default=False)
_STEPS = typer.Option(None, "--steps", help="Train this many global steps.", rich_help_panel="Job")
_EPOCHS = typer.Option(None, "--epochs", help="Train this many epochs.", rich_help_panel="Job")
_GLOBAL_BATCH = typer.Option(None, "--global-batch-size", "-b", help="Samples per step over all replicas.",
                             rich_help_panel="Job")
_INCLUDE = typer.Option([], "--include", help="Also bundle this file or folder (inside the recipe's folder).",
                        rich_help_panel="Job")
_DEBUG = typer.Option(False, "--debug", help="Show tracebacks.", rich_help_panel="Output")


@export_app.command("k8s")
def k8s(
    cluster_file: Path = typer.Argument(..., metavar="CLUSTER", help="The cluster file: one pod per worker host entry (and per ps host under parameter-server)."),
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="The recipe; its folder is bundled into a ConfigMap."),
    recipe_args: list[str] = _RECIPE_ARGS,
    strategy: str = typer.Option("multi-worker", "--strategy", "-s", help="multi-worker (every worker host) | parameter-server (worker hosts, and a ps pod per ps host) | mirrored | one-device (the first).", rich_help_panel="Job"),
    out: Path = typer.Option(Path("k8s"), "-o", "--out", help="Folder for the manifests (one YAML file each).", rich_help_panel="Output"),
    image: str = typer.Option("distrun:latest", "--image", help="A standard image with distrun installed (docs/kubernetes.md).", rich_help_panel="Kubernetes"),
    namespace: str | None = typer.Option(None, "--namespace", help="metadata.namespace of every object.", rich_help_panel="Kubernetes"),
    gpus_per_pod: int | None = typer.Option(None, "--gpus-per-pod", help="nvidia.com/gpu each worker pod asks for, one rank each (0: CPU pods). Required where a worker host has gpus: auto.", rich_help_panel="Kubernetes"),
    restarts: int = typer.Option(3, "--restarts", help="Times the job may fail and start again (backoffLimit: this x the pods); a pod lost to its node does not count.", rich_help_panel="Checkpoints and restarts"),
    checkpoint_dir: str | None = typer.Option(None, "--checkpoint-dir", help="Checkpoints go here in every pod (absolute); a restarted job resumes from the newest.", rich_help_panel="Checkpoints and restarts"),
    checkpoint_pvc: str | None = typer.Option(None, "--checkpoint-pvc", help="The PersistentVolumeClaim mounted at --checkpoint-dir (ReadWriteMany where several pods write); without it, an emptyDir (lost with the pod).", rich_help_panel="Checkpoints and restarts"),
    checkpoint_every: int | None = typer.Option(None, "--checkpoint-every", help="Write a checkpoint every N steps.", rich_help_panel="Checkpoints and restarts"),
    grace_s: int = typer.Option(60, "--grace-s", help="With --checkpoint-dir: terminationGracePeriodSeconds, the time a pod has from SIGTERM (a drain, a preemption) to checkpoint at one agreed step and stop.", rich_help_panel="Checkpoints and restarts"),
    ps_sync: bool = typer.Option(False, "--ps-sync", help="parameter-server: synchronous rounds (one update per step from every worker).", rich_help_panel="Job"),
    embeddings: str = typer.Option("dense", "--embeddings", help="multi-worker: dense (the tables in the model) | ps (the large tables on a ps pod per ps host, split by rows; the rest DDP).", rich_help_panel="Job"),
    ps_partition_mb: float | None = typer.Option(None, "--ps-partition-mb", help="--embeddings ps: tables larger than this go to the ps pods.", rich_help_panel="Job"),
    steps: int | None = _STEPS,
    epochs: int | None = _EPOCHS,
    global_batch_size: int | None = _GLOBAL_BATCH,
    include: list[Path] = _INCLUDE,
    debug: bool = _DEBUG,
) -> None:
    """Write Kubernetes manifests for RECIPE on CLUSTER's hosts: Secret, ConfigMap, headless Service,
    NetworkPolicy and an Indexed Job (and an Indexed Job of ps pods under parameter-server and
    --embeddings ps)."""
    cluster = load_cluster(cluster_file)
    name = StrategyName.parse(strategy)
    hosts = tuple(host for host in training_hosts(cluster, name) if Role.WORKER in host.roles)
    takes_ps = name is StrategyName.PARAMETER_SERVER or embeddings == "ps"
    ps = ps_hosts(cluster) if takes_ps else ()
    if takes_ps and not ps:
        needs = "--strategy parameter-server" if name is StrategyName.PARAMETER_SERVER else "--embeddings ps"
        raise UsageError(f"export k8s: {cluster_file}: {needs} needs hosts with the ps role (one ps pod each)")
    gpus = pod_gpus(hosts, gpus_per_pod, str(cluster_file))
    slots = {host.slots or gpus or 1 for host in hosts}
    if len(slots) != 1:
        raise UsageError(f"export k8s: {cluster_file}: every worker host needs the same slots (one pod template); "
                         f"they have {', '.join(map(str, sorted(slots)))}")
    per_pod = slots.pop()
    if gpus and per_pod > gpus:
        raise UsageError(f"export k8s: {cluster_file}: {per_pod} slots on pods of {gpus} GPU(s): one rank per GPU")
    if checkpoint_pvc and not checkpoint_dir:
        raise UsageError("--checkpoint-pvc: mounted at --checkpoint-dir, which is not given")
    if checkpoint_dir is not None and not checkpoint_dir.startswith("/"):
        raise UsageError(f"--checkpoint-dir: a path in the pods, where the volume mounts: expected an absolute "
                         f"path. Received: {checkpoint_dir}")
    if restarts < 0:
        raise UsageError(f"--restarts: expected 0 or more. Received: {restarts}")
    spec = build_spec(recipe=recipe, recipe_args=tuple(recipe_args or ()), strategy=name.value, device="cuda" if gpus else "cpu",
                      replicas=len(hosts) * per_pod, gpus=len(hosts) * per_pod if gpus else 0, steps=steps,
                      epochs=epochs, global_batch_size=global_batch_size, seed=None,
                      checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None,
                      checkpoint_every=checkpoint_every, ps_tasks=len(ps), ps_sync=ps_sync, embeddings=embeddings,
                      **({"ps_partition_mb": ps_partition_mb} if ps_partition_mb is not None else {}))
    if checkpoint_dir is not None:  # a path in the pods, not here
        spec = spec.replace(checkpoint_dir=checkpoint_dir)
    # A drained pod's SIGTERM: every rank checkpoints at one agreed step (as at Slurm's warning)
    # where distrun runs the loop and the replicas can agree (not parameter-server's workers).
    drain = bool(checkpoint_dir) and not takes_ps and inspect_recipe(spec.recipe).kind is RecipeKind.FIT
    if drain:
        spec = spec.replace(preemptible=True)
    if not 1 <= grace_s <= 3600:
        raise UsageError(f"--grace-s: expected 1 to 3600 seconds. Received: {grace_s}")
    bundle = pack(Path(spec.recipe), include)
    job = K8sJob(name=job_name(cluster, recipe), hosts=hosts, slots=per_pod, image=image, namespace=namespace,
                 gpus=gpus, ps_tasks=len(ps), checkpoint_dir=checkpoint_dir, checkpoint_pvc=checkpoint_pvc,
                 restarts=restarts, checkpoint_on_sigterm=drain, grace_s=grace_s)
    for path in write(manifests(job, spec, bundle), out):
        typer.echo(str(path))
    if checkpoint_dir and not checkpoint_pvc:
        stderr.print(f"warning: --checkpoint-dir {checkpoint_dir} is an emptyDir: its checkpoints are lost with their "
                     "pod, so a pod replaced after a node failure starts from step 0; give --checkpoint-pvc NAME "
                     "to resume", markup=False)
    what = f"{len(hosts)} pod(s) of {per_pod} process(es)" + (f" on {gpus} GPU(s) each" if gpus else " on CPU")
    stderr.print(f"note: {what}{f' + {len(ps)} ps pod(s)' if ps else ''}; `kubectl apply -f {out}`", markup=False)


@export_app.command("slurm")
def slurm(
    cluster_file: Path = typer.Argument(..., metavar="CLUSTER", help="A Slurm cluster file (scheduler: slurm): what to ask for."),
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="The recipe; its folder is bundled into the script."),
    recipe_args: list[str] = _RECIPE_ARGS,
    strategy: str = typer.Option("multi-worker", "--strategy", "-s", help="multi-worker | sharded (every node) | mirrored | one-device (the first node).", rich_help_panel="Job"),
    out: Path = typer.Option(Path("job.sbatch"), "-o", "--out", help="The sbatch script to write.", rich_help_panel="Output"),
    steps: int | None = _STEPS,
    epochs: int | None = _EPOCHS,
    global_batch_size: int | None = _GLOBAL_BATCH,
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="Checkpoints go here, on storage every node shares (relative: to the submit directory).", rich_help_panel="Checkpoints and requeue"),
    checkpoint_every: int | None = typer.Option(None, "--checkpoint-every", help="Write a checkpoint every N steps.", rich_help_panel="Checkpoints and requeue"),
    requeue: bool = typer.Option(False, "--requeue", help="At Slurm's warning (time limit, preemption) checkpoint, stop and requeue; the requeued job resumes. Needs --checkpoint-dir.", rich_help_panel="Checkpoints and requeue"),
    grace_s: int = typer.Option(120, "--grace-s", help="With --requeue: Slurm warns this many seconds before the time limit (--signal=B:USR1@N).", rich_help_panel="Checkpoints and requeue"),
    include: list[Path] = _INCLUDE,
    debug: bool = _DEBUG,
) -> None:
    """Write an sbatch script that trains RECIPE on the cluster file's Slurm request, without the client."""
    cluster = load_cluster(cluster_file)
    if cluster.slurm is None:
        raise UsageError(f"export slurm: {cluster_file}: not a Slurm cluster file (it needs `scheduler: slurm` and "
                         "a `slurm:` section saying what to ask for)")
    name = StrategyName.parse(strategy)
    if name is StrategyName.PARAMETER_SERVER:
        raise UsageError("export slurm: --strategy parameter-server is not exported yet (its ps tasks need nodes "
                         "of their own); use multi-worker or sharded")
    every_node = name in (StrategyName.MULTI_WORKER, StrategyName.SHARDED)  # the others run on one host
    nodes = cluster.slurm.nodes if every_node else 1
    gpus = cluster.slurm.gpus_per_node or 0
    per_node = gpus or 1
    spec = build_spec(recipe=recipe, recipe_args=tuple(recipe_args or ()), strategy=name.value,
                      device="cuda" if gpus else "cpu", replicas=nodes * per_node, gpus=nodes * gpus,
                      steps=steps, epochs=epochs, global_batch_size=global_batch_size, seed=None,
                      checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, preemptible=requeue)
    if requeue and inspect_recipe(spec.recipe).kind is not RecipeKind.FIT:
        raise UsageError(f"export slurm --requeue: {recipe} is not a fit-style recipe; distrun checkpoints at "
                         "Slurm's warning only in the loop it runs (a custom loop or script saves its own)")
    if not 10 <= grace_s <= 65535:
        raise UsageError(f"--grace-s: expected 10 to 65535 seconds. Received: {grace_s}")
    if checkpoint_dir is not None:  # the script resolves it on the cluster, not here
        spec = spec.replace(checkpoint_dir=str(checkpoint_dir))
    bundle = pack(Path(spec.recipe), include)
    name_of_job = f"distrun-{cluster.name}-{recipe.stem}"[:64]
    script = sbatch_script(SlurmBatch(cluster=cluster, spec=spec, bundle=bundle, nodes=nodes, slots=per_node,
                                      job_name=name_of_job, requeue=requeue, grace_s=grace_s))
    # 0600: the script holds the code, the recipe's arguments and the cluster file's env:.
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_TRUNC
    with os.fdopen(fd, "w") as handle:
        handle.write(script)
    typer.echo(str(out))
    stderr.print(f"note: {nodes} node(s) of {per_node} rank(s); `sbatch {out}`", markup=False)
