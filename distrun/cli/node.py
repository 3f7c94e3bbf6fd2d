"""`distrun node`: one pod's (or one machine's) share of a job, started by a scheduler.

The entrypoint of the pods ``distrun export k8s`` describes, and of the srun step
``distrun export slurm`` writes. A scheduler (Kubernetes,
Slurm) starts this once per node. It unpacks the shipped bundle, then starts and
supervises the node's ranks with the same launcher as a worker server, and with the same
torchrun environment and TF_CONFIG. Node 0 hosts the rendezvous on ``--master-port``.
Events go to stdout as NDJSON, like ``distrun train --json``. The exit code follows
docs/cli.md: 0, or the code of the first failure's error.
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
from pathlib import Path

import typer

from distrun.cli._app import app, stderr
from distrun.client._results import CHECKPOINT_NAME
from distrun.client.local import failure_message
from distrun.config import JobSpec
from distrun.errors import TrainingError, UsageError
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
    nnodes: int = typer.Option(..., "--nnodes", help="Nodes in the job.", rich_help_panel="Nodes and rendezvous"),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="Ranks on this node.", rich_help_panel="Nodes and rendezvous"),
    node_rank: int | None = typer.Option(None, "--node-rank", help="This node's index (default: $JOB_COMPLETION_INDEX, Kubernetes' Indexed Job; else $SLURM_NODEID).", rich_help_panel="Nodes and rendezvous"),
    master_addr: str = typer.Option(..., "--master-addr", help="Node 0's address.", rich_help_panel="Nodes and rendezvous"),
    master_port: int = typer.Option(29500, "--master-port", help="The rendezvous port node 0 listens on.", rich_help_panel="Nodes and rendezvous"),
    node_host: str = typer.Option("", "--node-host", help="Each node's address, with {index} for its index (TF_CONFIG); default: --master-addr.", rich_help_panel="Nodes and rendezvous"),
    node_hosts: str = typer.Option("", "--node-hosts", help="Every node's address, comma-separated, in node order (instead of --node-host).", rich_help_panel="Nodes and rendezvous"),
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="Override the spec's checkpoint folder (relative: to where this runs).", rich_help_panel="Checkpoints and requeue"),
    resume_if_any: bool = typer.Option(False, "--resume-if-any", help="Resume from the newest checkpoint in the checkpoint folder if it has one (a requeued job).", rich_help_panel="Checkpoints and requeue"),
    preempted_file: Path | None = typer.Option(None, "--preempted-file", help="Write this file when every rank checkpointed and stopped on SIGUSR1 (before exiting 75).", rich_help_panel="Checkpoints and requeue"),
    run_id: str = typer.Option("node", "--run-id", help="TORCHELASTIC_RUN_ID of the job.", rich_help_panel="Job"),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks.", rich_help_panel="Output"),
) -> None:
    """Run one node's ranks of a job (the pod entrypoint of `distrun export k8s`, the srun task of `export slurm`)."""
    warned = []  # Slurm's warning may come before the launcher exists: kept, handed on at once
    signal.signal(signal.SIGUSR1, lambda *_: warned.append(True))
    index = node_rank if node_rank is not None else int(
        os.environ.get("JOB_COMPLETION_INDEX", os.environ.get("SLURM_NODEID", "-1")))
    if not 0 <= index < nnodes:
        raise UsageError(f"--node-rank: expected 0..{nnodes - 1} (or JOB_COMPLETION_INDEX, SLURM_NODEID). "
                         f"Received: {index}")
    addresses = [host for host in node_hosts.split(",") if host] if node_hosts else []
    if node_hosts and len(addresses) != nnodes:
        raise UsageError(f"--node-hosts: expected {nnodes} addresses (--nnodes). Received: {len(addresses)}")
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
        hosts = tuple((addresses[i] if addresses else node_host.format(index=i) if node_host else master_addr)
                      for i in range(nnodes) for _ in range(nproc_per_node))
        secret = os.environ.get(JOB_SECRET_VAR, "")
        parse_job_secret(secret, f"${JOB_SECRET_VAR} (the job's Kubernetes Secret)")
        listener = None
        if index == 0:  # node 0 hosts the rendezvous, as the chief's worker server does, on its own address
            address = address_to_bind(master_addr)
            if address is None:
                raise UsageError(f"--master-addr {master_addr!r}: not an address of this node, nor one it can route to")
            listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, master_port))
            listener.listen(1024)
        worker = WorkerSpec(
            argv=(sys.executable, "-m", "distrun.runtime"), local_world_size=nproc_per_node,
            world_size=nnodes * nproc_per_node, rank_offset=index * nproc_per_node, node_rank=index,
            master_addr=master_addr, master_port=None if index == 0 else master_port,
            env={JOB_SPEC_VAR: spec.to_json(), **spec.extra_env}, cwd=str(root), rank_hosts=hosts, run_id=run_id,
            elastic=spec.strategy.elastic, respawns=3 if spec.strategy.elastic else 0, job_secret=secret,
            debug_dir=str(work / "debug"),
        )

        def emit(event: Event) -> None:
            sys.stdout.write(json.dumps(event_to_dict(event)) + "\n")
            sys.stdout.flush()

        launcher = LocalLauncher(worker, emit, listener=listener)
        # Slurm's warning that the job will end (srun hands the batch script's SIGUSR1 on to us).
        signal.signal(signal.SIGUSR1, lambda *_: launcher.preempt())
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



def _has_checkpoint(folder: Path) -> bool:
    """A published checkpoint in ``folder`` (either format; a ``.tmp-`` one is not published)."""
    try:
        return any(CHECKPOINT_NAME.match(entry.name) for entry in folder.iterdir())
    except OSError:
        return False
