"""`distrun node`: one pod's (or one machine's) share of a job, started by a scheduler.

The entrypoint of the pods ``distrun export k8s`` describes, and of the srun step
``distrun export slurm`` writes. A scheduler (Kubernetes,
Slurm) starts this once per node. It unpacks the shipped bundle, then starts and
supervises the node's ranks with the same launcher as a worker server, and with the same
torchrun environment and TF_CONFIG. Node 0 hosts the rendezvous on ``--master-port``.
Events go to stdout as NDJSON, like ``distrun train --json``. The exit code follows
docs/cli.md: 0, or the code of the first failure's error.

Where a deployment already sets TF_CONFIG per task (a TensorFlow cluster manager, the
seeds' Kubernetes template, ``export k8s`` of parameter-server), TF_CONFIG in the
environment and none of --nnodes/--node-rank/--master-addr/--master-port/--node-host(s)
says all of that instead (``config/_tf_config``): the chief and workers are the nodes,
the chief is node 0 and the rendezvous, a ``ps`` task runs one ps rank. TF_CONFIG
together with those flags is refused: two sources for one answer would disagree silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import typer

from distrun.cli._app import app, stderr
from distrun.cli._node_evaluator import evaluate_checkpoints
from distrun.client._results import CHECKPOINT_NAME
from distrun.client.local import failure_message, independent_ranks
from distrun.config import JobSpec, StrategyName
from distrun.config._tf_config import TF_CONFIG_VAR, TfConfig, parse_tf_config
from distrun.errors import ConfigError, TrainingError, UsageError
from distrun.launch import LocalLauncher, ProcessState, WorkerSpec
from distrun.protocol import Event, event_to_dict
from distrun.protocol.environment import JOB_SECRET_VAR, JOB_SPEC_VAR, PREEMPTED_EXIT_CODE
from distrun.protocol.secret import parse_job_secret
from distrun.server._bundle import unpack
from distrun.server._net import address_to_bind


@app.command(hidden=False)
def node(
    bundle: Path = typer.Option(..., "--bundle", help="The recipe's bundle (.tar.gz, as `distrun train` ships it).", rich_help_panel="Job"),
    spec_file: Path = typer.Option(..., "--spec", help="The job spec (JSON).", rich_help_panel="Job"),
    recipe: str = typer.Option(..., "--recipe", help="The recipe's path inside the bundle.", rich_help_panel="Job"),
    nnodes: int | None = typer.Option(None, "--nnodes", help="Nodes in the job (required without TF_CONFIG).", rich_help_panel="Nodes and rendezvous"),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="Ranks on this node.", rich_help_panel="Nodes and rendezvous"),
    node_rank: int | None = typer.Option(None, "--node-rank", help="This node's index (default: $JOB_COMPLETION_INDEX, Kubernetes' Indexed Job; else $SLURM_NODEID).", rich_help_panel="Nodes and rendezvous"),
    master_addr: str | None = typer.Option(None, "--master-addr", help="Node 0's address (required without TF_CONFIG).", rich_help_panel="Nodes and rendezvous"),
    master_port: int | None = typer.Option(None, "--master-port", help="The rendezvous port node 0 listens on (default 29500).", rich_help_panel="Nodes and rendezvous"),
    node_host: str = typer.Option("", "--node-host", help="Each node's address, with {index} for its index (TF_CONFIG); default: --master-addr.", rich_help_panel="Nodes and rendezvous"),
    node_hosts: str = typer.Option("", "--node-hosts", help="Every node's address, comma-separated, in node order (instead of --node-host).", rich_help_panel="Nodes and rendezvous"),
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="Override the spec's checkpoint folder (relative: to where this runs).", rich_help_panel="Checkpoints and requeue"),
    resume_if_any: bool = typer.Option(False, "--resume-if-any", help="Resume from the newest checkpoint in the checkpoint folder if it has one (a requeued job).", rich_help_panel="Checkpoints and requeue"),
    preempted_file: Path | None = typer.Option(None, "--preempted-file", help="Write this file when every rank checkpointed and stopped on SIGUSR1 (before exiting 75).", rich_help_panel="Checkpoints and requeue"),
    checkpoint_on_sigterm: bool = typer.Option(False, "--checkpoint-on-sigterm", help="SIGTERM (Kubernetes' drain, eviction, preemption) acts as SIGUSR1: every rank checkpoints at one agreed step and stops, exit 75.", rich_help_panel="Checkpoints and requeue"),
    evaluator_idle_s: float = typer.Option(600.0, "--evaluator-idle-s", min=0.0, help="TF_CONFIG's evaluator task: end when no new checkpoint came for this long (it ends at once after the job's last --steps).", rich_help_panel="Checkpoints and requeue"),
    run_id: str = typer.Option("node", "--run-id", help="TORCHELASTIC_RUN_ID of the job.", rich_help_panel="Job"),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks.", rich_help_panel="Output"),
) -> None:
    """Run one node's ranks of a job (the pod entrypoint of `distrun export k8s`, the srun task of
    `export slurm`); with TF_CONFIG in the environment and no --nnodes/--node-rank/--master-addr/--master-port,
    TF_CONFIG says the nodes."""
    warned = []  # Slurm's warning may come before the launcher exists: kept, handed on at once
    told = (signal.SIGUSR1, signal.SIGTERM) if checkpoint_on_sigterm else (signal.SIGUSR1,)
    for signum in told:
        signal.signal(signum, lambda *_: warned.append(True))
    flags = {"--nnodes": nnodes, "--node-rank": node_rank, "--master-addr": master_addr,
             "--master-port": master_port, "--node-host": node_host or None, "--node-hosts": node_hosts or None}
    place = _from_tf_config(os.environ[TF_CONFIG_VAR], flags) if os.environ.get(TF_CONFIG_VAR) \
        else _from_flags(nnodes, node_rank, master_addr, master_port, node_host, node_hosts)
    index, nnodes, master_addr, master_port = place.index, place.nnodes, place.master_addr, place.master_port
    work = Path(tempfile.mkdtemp(prefix="distrun-node-"))  # the bundle, the ranks' error files: removed at the end
    try:
        data = bundle.read_bytes()
        root = unpack(bundle, hashlib.sha256(data).hexdigest(), work / "b")
        path = (root / recipe).resolve()
        if root.resolve() not in path.parents or not path.is_file():
            raise UsageError(f"--recipe {recipe!r} is not in the bundle")
        spec = JobSpec.from_json(spec_file.read_text()).replace(recipe=str(path))
        if checkpoint_dir is not None:
            spec = spec.replace(checkpoint_dir=str(checkpoint_dir.expanduser().resolve()))
        if resume_if_any and spec.checkpoint.dir and _has_checkpoint(Path(spec.checkpoint.dir)):
            spec = spec.replace(resume=True)
        secret = os.environ.get(JOB_SECRET_VAR, "")
        parse_job_secret(secret, f"${JOB_SECRET_VAR} (the job's Kubernetes Secret)")
        if place.evaluator:  # TF_CONFIG's side-car evaluator: the shared checkpoint folder, each new checkpoint
            signal.signal(signal.SIGTERM, lambda *_: warned.append(True))  # a pod's end: nothing to checkpoint
            if not spec.checkpoint.dir:
                raise ConfigError(f"{TF_CONFIG_VAR}: task.type evaluator needs the job's checkpoint folder "
                                  "(--checkpoint-dir, a volume the chief writes and this task reads)")
            count = evaluate_checkpoints(spec, root, _emit, secret=secret, idle_s=evaluator_idle_s,
                                         describe_failure=failure_message, work=work, stopped=lambda: bool(warned))
            stderr.print(f"evaluator: {count} checkpoint(s) of {spec.checkpoint.dir} evaluated", markup=False)
            return
        if place.tf_config is not None:
            spec = _spec_for(spec, place.tf_config, nnodes * nproc_per_node)
        hosts = tuple(host for host in place.node_hosts for _ in range(nproc_per_node)) + place.ps_hosts
        listener = None
        if index == 0:  # node 0 hosts the rendezvous, as the chief's worker server does, on its own address
            address = address_to_bind(master_addr)
            if address is None:
                raise UsageError(f"--master-addr {master_addr!r}: not an address of this node, nor one it can route to")
            listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, master_port))
            listener.listen(1024)
        trainers, ps = nnodes * nproc_per_node, len(place.ps_hosts)
        first_rank = trainers + index - nnodes if place.ps_task else index * nproc_per_node  # ps tasks: after trainers
        worker = WorkerSpec(
            argv=(sys.executable, "-m", "distrun.runtime"), local_world_size=1 if place.ps_task else nproc_per_node,
            world_size=trainers + ps, rank_offset=first_rank,
            node_rank=index, master_addr=master_addr, master_port=None if index == 0 else master_port,
            env={JOB_SPEC_VAR: spec.to_json(), **spec.extra_env}, cwd=str(root), rank_hosts=hosts, run_id=run_id,
            evaluator_hosts=place.evaluator_hosts, num_ps=ps, independent_ranks=independent_ranks(spec),
            elastic=spec.strategy.elastic, respawns=3 if spec.strategy.elastic else 0, job_secret=secret,
            debug_dir=str(work / "debug"),
        )

        launcher = LocalLauncher(worker, _emit, listener=listener)
        # Slurm's warning that the job will end (srun hands the batch script's SIGUSR1 on to us);
        # with --checkpoint-on-sigterm, the kubelet's SIGTERM before it kills a pod's container.
        for signum in told:
            signal.signal(signum, lambda *_: launcher.preempt())
        if warned:
            launcher.preempt()
        result = launcher.run()
        if result.state is ProcessState.SUCCEEDED:
            return
        if result.state is ProcessState.PREEMPTED:
            if preempted_file is not None:
                preempted_file.write_text(f"node {index}\n")
            stderr.print(f"node {index}: told the job would end; every rank wrote its checkpoint and stopped "
                         f"(exit {PREEMPTED_EXIT_CODE}: requeue it to resume)", markup=False)
            raise typer.Exit(PREEMPTED_EXIT_CODE)
        message = failure_message(result.failure)
        stderr.print(f"error: node {index}: {message}", markup=False)
        raise typer.Exit(TrainingError.exit_code)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _emit(event: Event) -> None:
    """The node's events, one JSON object a line on stdout (the pod's log)."""
    sys.stdout.write(json.dumps(event_to_dict(event)) + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class _Placement:
    """Where this node sits in the job, from the flags or from TF_CONFIG."""

    index: int  # node rank; a ps task's is nnodes + its ps index
    nnodes: int  # training nodes
    master_addr: str
    master_port: int
    node_hosts: tuple[str, ...]  # each training node's address, in node order
    ps_hosts: tuple[str, ...] = ()
    evaluator_hosts: tuple[str, ...] = ()
    tf_config: TfConfig | None = None
    evaluator: bool = False  # TF_CONFIG's evaluator task: no rank, the checkpoints of the folder

    @property
    def ps_task(self) -> bool:
        return self.index >= self.nnodes


def _from_flags(nnodes: int | None, node_rank: int | None, master_addr: str | None, master_port: int | None,
                node_host: str, node_hosts: str) -> _Placement:
    for flag, value in (("--nnodes", nnodes), ("--master-addr", master_addr)):
        if value is None:
            raise UsageError(f"{flag}: required (or {TF_CONFIG_VAR} in the environment, which says the nodes)")
    index = node_rank if node_rank is not None else int(
        os.environ.get("JOB_COMPLETION_INDEX", os.environ.get("SLURM_NODEID", "-1")))
    if not 0 <= index < nnodes:
        raise UsageError(f"--node-rank: expected 0..{nnodes - 1} (or JOB_COMPLETION_INDEX, SLURM_NODEID). "
                         f"Received: {index}")
    addresses = tuple(host for host in node_hosts.split(",") if host) if node_hosts else ()
    if node_hosts and len(addresses) != nnodes:
        raise UsageError(f"--node-hosts: expected {nnodes} addresses (--nnodes). Received: {len(addresses)}")
    hosts = addresses or tuple(node_host.format(index=i) if node_host else master_addr for i in range(nnodes))
    return _Placement(index, nnodes, master_addr, 29500 if master_port is None else master_port, hosts)


def _from_tf_config(text: str, flags: dict[str, object]) -> _Placement:
    given = [flag for flag, value in flags.items() if value is not None]
    if given:
        raise ConfigError(f"{TF_CONFIG_VAR}: set in the environment together with {given[0]}; give one or the "
                          f"other (unset {TF_CONFIG_VAR}, or drop {', '.join(given)})")
    tf = parse_tf_config(text)
    return _Placement(tf.node_rank, tf.nnodes, tf.master_addr, tf.rendezvous_port, tf.training_hosts,
                      tf.ps_hosts, tf.evaluator_hosts, tf, evaluator=tf.task_type == "evaluator")


def _spec_for(spec: JobSpec, tf: TfConfig, trainers: int) -> JobSpec:
    """The job spec with TF_CONFIG's shape: its training ranks the replicas, its ps entries the ps tasks
    (TensorFlow's rule: the cluster, not the program, says how many workers there are)."""
    parameter_server = spec.strategy.name is StrategyName.PARAMETER_SERVER
    hybrid = spec.strategy.embeddings == "ps"  # the tables on the ps tasks, the dense layers DDP's
    if tf.ps_hosts and not (parameter_server or hybrid):
        raise ConfigError(f"{TF_CONFIG_VAR}: cluster.ps has {len(tf.ps_hosts)} entries, but the job's strategy is "
                          f"{spec.strategy.name.value} (ps tasks run under parameter-server and --embeddings ps)")
    if (parameter_server or hybrid) and not tf.ps_hosts:
        needs = "parameter-server" if parameter_server else "--embeddings ps"
        raise ConfigError(f"{TF_CONFIG_VAR}: cluster.ps: {needs} needs at least one ps entry")
    per_replica = spec.parallel.ranks_per_replica
    if trainers % per_replica:
        raise ConfigError(f"{TF_CONFIG_VAR}: cluster has {trainers} training ranks (chief and workers x "
                          f"--nproc-per-node); the job's replicas are {per_replica} ranks each (--tp x --pp)")
    changes = {"replicas": trainers // per_replica, "ps_tasks": len(tf.ps_hosts)}
    if spec.strategy.replicas == changes["replicas"] and spec.ps.tasks == changes["ps_tasks"]:
        return spec
    return spec.replace(**changes)


def _has_checkpoint(folder: Path) -> bool:
    """A published checkpoint in ``folder`` (either format; a ``.tmp-`` one is not published)."""
    try:
        return any(CHECKPOINT_NAME.match(entry.name) for entry in folder.iterdir())
    except OSError:
        return False
