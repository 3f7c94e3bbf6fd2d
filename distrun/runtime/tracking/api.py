"""What a tracker is to distrun, and the parameters every run is logged with.

One small protocol, so the tap that translates events never knows which tracker it talks
to, and a tracker never sees an event: MLflow and W&B differ in how they name a summary or
store an artifact, not in what distrun asks of them.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from distrun._version import __version__ as distrun_version
from distrun.config import JobSpec

__all__ = ["Tracker", "RunParams", "worker_hosts"]


class Tracker(Protocol):
    """One experiment tracker's run, driven by rank 0's tap.

    ``start`` runs on the training thread before the first step and raises ``ConfigError``
    (one line) when the tracker cannot be used; every other call runs on the tap's own
    thread, in order, and may raise anything: the tap reports it and goes on.
    """

    #: The ``--tracker`` name ("mlflow", "wandb"), for messages.
    name: str

    def start(self, params: RunParams) -> None: ...

    def log_metrics(self, step: int, metrics: Mapping[str, float], wall_time_s: float) -> None: ...

    def log_summary(self, summary: Mapping[str, float]) -> None: ...

    def log_artifact(self, path: str) -> None:
        """A checkpoint: a ``ckpt-N.pt`` file or a sharded ``ckpt-N/`` folder."""

    def finish(self, failed: bool) -> None: ...


@dataclass(frozen=True)
class RunParams:
    """The run's parameters, logged once at its start: enough to tell two runs apart and to
    redo one (the recipe's hash pins its code; the versions pin the software)."""

    strategy: str
    replicas: int
    world_size: int
    #: the training hosts, in rank order, each once ("a,b": one string, so MLflow and W&B agree)
    hosts: str
    global_batch_size: int | None
    precision: str
    compile: bool
    compression: str
    seed: int
    steps: int | None
    epochs: int | None
    recipe: str  # the file's name; its path differs between this machine and a cluster host
    recipe_sha256: str
    distrun_version: str
    torch_version: str
    python_version: str
    #: the layout of a replica (--tp, --pp, its schedule and microbatches; 1, 1, None, None without
    #: them) and --activation-checkpointing: runs of one model in two layouts must not look alike
    tp: int = 1
    pp: int = 1
    pp_schedule: str | None = None
    microbatches: int | None = None
    activation_checkpointing: str = "none"

    @classmethod
    def from_spec(cls, spec: JobSpec, *, world_size: int, tf_config: str | None) -> RunParams:
        """``tf_config``: the TF_CONFIG variable the launcher set (it names every worker's host)."""
        import torch  # already imported by the training process: only its version is read

        recipe = Path(spec.recipe)
        training, parallel = spec.training, spec.parallel
        return cls(
            strategy=spec.strategy.name.value, replicas=spec.strategy.replicas, world_size=world_size,
            hosts=",".join(worker_hosts(tf_config)), global_batch_size=training.global_batch_size,
            precision=spec.precision.name, compile=spec.precision.compile, compression=spec.communication.compression,
            seed=training.seed, steps=training.steps, epochs=training.epochs, recipe=recipe.name, tp=parallel.tp,
            pp=parallel.pp, pp_schedule=parallel.pp_schedule if parallel.pp > 1 else None,
            microbatches=parallel.pipeline_microbatches if parallel.pp > 1 else None,
            activation_checkpointing=parallel.activation_checkpointing,
            recipe_sha256=hashlib.sha256(recipe.read_bytes()).hexdigest(),
            distrun_version=distrun_version, torch_version=str(torch.__version__),
            python_version=platform.python_version(),
        )

    def as_dict(self) -> dict[str, str | int | bool]:
        """Parameters that have a value (``steps`` or ``epochs`` is None, say, and left out)."""
        return {name: value for name, value in asdict(self).items() if value is not None}


def worker_hosts(tf_config: str | None) -> tuple[str, ...]:
    """The worker hosts TF_CONFIG lists (``host:port`` each), host part only, each once, in order."""
    try:
        workers = json.loads(tf_config or "{}")["cluster"]["worker"]
    except (KeyError, TypeError, ValueError):
        return ("localhost",)
    hosts: dict[str, None] = {}
    for address in workers:
        host = str(address).rsplit(":", 1)[0] if ":" in str(address) else str(address)
        hosts.setdefault(host.strip("[]"), None)  # "[::1]:29500": IPv6 in brackets
    return tuple(hosts) or ("localhost",)
