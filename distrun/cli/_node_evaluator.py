"""`distrun node` as TF_CONFIG's ``evaluator`` task: the side-car evaluator of a deployment.

TensorFlow's evaluator task stands apart from training: it is in TF_CONFIG's ``cluster`` but
not in the training's group, it watches the checkpoint folder the chief writes
(``tf.train.checkpoints_iterator``), and it evaluates each new checkpoint on its own device
while the training goes on. ``distrun train --cluster`` ships each checkpoint to its evaluator
host itself; a deployment started from TF_CONFIG has no client, so here the folder is shared
(the volume the chief writes, ``--checkpoint-dir``) and this task reads it.

Each checkpoint is evaluated by one fresh process, exactly as the cluster's evaluator host runs
it (``config.evaluator_spec``: one device, no process group, the recipe's ``eval_data``), so
its ``eval`` event carries the same figures. The task ends when it has evaluated a checkpoint
of the job's last step (``--steps``); when no new checkpoint came for ``idle_s``, counted from
the task's start and from each checkpoint, as TensorFlow's ``checkpoints_iterator`` times out
(an ``--epochs`` job's last step is not known here, and a training that failed writes no more);
or when it is told to stop (SIGTERM or SIGUSR1: a pod's end), after the evaluation under way.
An evaluation that failed on a checkpoint a newer one has since replaced (``--keep-checkpoints``
may have removed it under the reader) is passed over for the newer one; any other failure is
the job's error.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from distrun.client._results import CHECKPOINT_NAME
from distrun.config import JobSpec, evaluator_spec
from distrun.errors import TrainingError
from distrun.launch import LocalLauncher, ProcessState, WorkerSpec
from distrun.protocol import Event
from distrun.protocol.environment import EVAL_CHECKPOINT_VAR, JOB_SPEC_VAR

__all__ = ["evaluate_checkpoints"]

#: How often the folder is listed for a new checkpoint.
POLL_S = 1.0


def evaluate_checkpoints(spec: JobSpec, root: Path, emit: Callable[[Event], None], *, secret: str, idle_s: float,
                         describe_failure: Callable[[object], str], work: Path,
                         stopped: Callable[[], bool] = lambda: False) -> int:
    """Evaluate each new checkpoint in ``spec.checkpoint.dir`` until the job's last step, ``idle_s``
    without one, or ``stopped()``; how many were evaluated."""
    folder = Path(str(spec.checkpoint.dir))
    one = evaluator_spec(spec)
    last_step = spec.training.steps
    done_step, evaluated, quiet_since = -1, 0, time.monotonic()
    while not stopped():
        newer = [(step, path) for step, path in _published(folder) if step > done_step]
        if not newer:
            if time.monotonic() - quiet_since > idle_s:
                return evaluated
            time.sleep(POLL_S)
            continue
        step, path = newer[-1]  # the newest only: TF's iterator skips those it fell behind on
        result = LocalLauncher(_worker(one, root, path, secret, work), emit).run()
        if result.state is not ProcessState.SUCCEEDED and not any(later > step for later, _ in _published(folder)):
            raise TrainingError(f"evaluator: checkpoint {path}: {describe_failure(result.failure)}")
        evaluated += result.state is ProcessState.SUCCEEDED
        done_step, quiet_since = step, time.monotonic()
        if last_step is not None and step >= last_step:
            return evaluated
    return evaluated


def _published(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of each published checkpoint, plain or sharded, oldest first (the chief writes
    under a ``.tmp-`` name and renames: a listed one is whole). Read without torch: the control
    plane never imports it."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    return sorted((int(entry.name[5:].removesuffix(".pt")), entry) for entry in entries
                  if CHECKPOINT_NAME.match(entry.name))


def _worker(spec: JobSpec, root: Path, checkpoint: Path, secret: str, work: Path) -> WorkerSpec:
    """One process, one device, no process group: the cluster evaluator host's own (server/_jobs)."""
    return WorkerSpec(
        argv=(sys.executable, "-m", "distrun.runtime"), local_world_size=1, world_size=1, rank_offset=0, node_rank=0,
        master_addr="127.0.0.1", master_port=None,
        env={JOB_SPEC_VAR: spec.to_json(), EVAL_CHECKPOINT_VAR: str(checkpoint), **spec.extra_env}, cwd=str(root),
        task_type="evaluator", job_secret=secret, debug_dir=str(work / "debug"),
    )
