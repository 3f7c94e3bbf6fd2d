"""The environment of one training process: torchrun's variables and TF_CONFIG.

A plain torchrun script must run unchanged, so every process gets exactly the
variables torchrun sets. TF_CONFIG describes the same cluster the TensorFlow way
(task type and index) for recipes written against it; with no explicit chief,
worker 0 is the chief, as in TensorFlow's MultiWorkerMirroredStrategy.
"""

from __future__ import annotations

import json
import os
import socket

from distrun.launch.api import WorkerSpec
from distrun.protocol.environment import (
    CHIEF_ADDR_VAR,
    DEBUG_DIR_VAR,
    ERROR_FILE_PREFIX,
    ERROR_FILE_VAR,
    FLIGHT_RECORDER_ENTRIES,
    FLIGHT_RECORDER_VAR,
    JOB_SECRET_VAR,
    SUPERVISOR_PID_VAR,
)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _loopback_ifname() -> str | None:
    """The loopback interface's name ("lo" on Linux), for gloo on a job of this machine alone."""
    try:
        return next((name for _index, name in socket.if_nameindex() if name == "lo"), None)
    except OSError:
        return None


_LOOPBACK_IFNAME = _loopback_ifname()


def process_env(spec: WorkerSpec, local_rank: int, master_port: int, store_port: int | None,
                secret_hex: str) -> dict[str, str]:
    """A process's whole environment: ours, the job's, torchrun's (``rank_env``), the job secret,
    the Flight Recorder's settings, and gloo kept on loopback for a job of this machine alone."""
    env = dict(os.environ)
    env.update(spec.env)
    env.update(rank_env(spec, local_rank, master_port, store_port))
    env[JOB_SECRET_VAR] = secret_hex
    env[SUPERVISOR_PID_VAR] = str(os.getpid())
    env.setdefault(FLIGHT_RECORDER_VAR, str(FLIGHT_RECORDER_ENTRIES))  # the user's setting wins (0: off)
    if spec.debug_dir:
        env[DEBUG_DIR_VAR] = spec.debug_dir
        env.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(spec.debug_dir, "nccl-trace-rank-"))
        # torchrun's agent names one per worker too; here it lives where the launcher clears it.
        env[ERROR_FILE_VAR] = os.path.join(spec.debug_dir, f"{ERROR_FILE_PREFIX}{env['RANK']}.json")
    if spec.master_addr in _LOOPBACK and "GLOO_SOCKET_IFNAME" not in env and _LOOPBACK_IFNAME:
        env["GLOO_SOCKET_IFNAME"] = _LOOPBACK_IFNAME  # gloo's listeners stay on loopback too
    return env


def rank_env(spec: WorkerSpec, local_rank: int, master_port: int, store_port: int | None = None) -> dict[str, str]:
    """``master_port``: the job's rendezvous port (TF_CONFIG names it); ``store_port``: where this
    host's ranks reach the store, on loopback (the store itself, or this host's relay to it;
    ``launch/_store_relay``). None: the rendezvous port, on the chief's address."""
    world = spec.effective_world_size
    rank = spec.rank_offset + local_rank
    cpus = os.cpu_count() or 1
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "GROUP_RANK": str(spec.node_rank),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": spec.master_addr if store_port is None else "127.0.0.1",
        "MASTER_PORT": str(master_port if store_port is None else store_port),
        CHIEF_ADDR_VAR: spec.master_addr,
        # All ranks connect to the store as clients; rank 0 hosts it on the socket
        # the launcher bound (see runtime bootstrap), exactly as torchrun's agent store.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        # The rest of torchrun's contract. TORCHELASTIC_RUN_ID is how torch
        # (is_torchelastic_launched) and Lightning (TorchElasticEnvironment) know a launcher
        # set all this; process_env adds TORCHELASTIC_ERROR_FILE, one per rank.
        "ROLE_NAME": "default",
        "GROUP_WORLD_SIZE": str(len(set(spec.rank_hosts)) if spec.rank_hosts else 1),
        "TORCHELASTIC_RUN_ID": spec.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(spec.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TF_CONFIG": json.dumps(_tf_config(spec, rank, master_port)),
        "PYTHONUNBUFFERED": "1",
    }
    # Share the cores between local replicas instead of oversubscribing them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // spec.local_world_size)))
    return env


def _tf_config(spec: WorkerSpec, rank: int, master_port: int) -> dict[str, object]:
    """TensorFlow's view of the same job: every rank a worker task (worker 0 is the chief,
    TensorFlow's rule when no "chief" task is listed), each named by its host; evaluators
    listed apart. The port is the job's rendezvous port (tasks share it: it is descriptive)."""
    world = spec.effective_world_size
    hosts = spec.rank_hosts or (spec.master_addr,) * world
    workers = world - spec.num_ps
    cluster: dict[str, list[str]] = {"worker": [f"{host}:{master_port}" for host in hosts[:workers]]}
    if spec.num_ps:
        cluster["ps"] = [f"{host}:{master_port}" for host in hosts[workers:]]
    if spec.evaluator_hosts:
        cluster["evaluator"] = [f"{host}:{master_port}" for host in spec.evaluator_hosts]
    if spec.task_type == "evaluator":
        task = {"type": "evaluator", "index": 0}
    elif rank >= workers:
        task = {"type": "ps", "index": rank - workers}
    else:
        task = {"type": spec.task_type, "index": rank}
    return {"cluster": cluster, "task": task}
