"""What a rank that ended on its own, without a Failed event of its own, is said to have died of.

Its exit code or signal, the kernel's OOM killer named when it was that (``launch/_oom``), and
under ``--embeddings ps --elastic`` a ps task named as one: the dense replicas heal, but a ps task
holds its tables' rows alone, so started again it would hold none. Its loss is the job's failure,
said first, rather than a replica's reset connection to it (``PsTaskLost``, a consequence).
"""

from __future__ import annotations

import signal
from dataclasses import replace

from distrun.launch._oom import OomWatch
from distrun.launch._proc import describe_exit
from distrun.protocol import OOM_KILLED, Failed

__all__ = ["exit_failure", "ps_task_lost", "ps_task_of"]


def exit_failure(oom: OomWatch, rank: int, rc: int, now: float) -> Failed:
    """The failure of ``rank``, which exited with ``rc`` without saying why."""
    explained = oom.explain(rank) if rc == -signal.SIGKILL else None
    if explained is not None:
        return Failed(rank=rank, time=now, kind=OOM_KILLED, message=explained)
    return Failed(rank=rank, time=now, kind="exited", message=describe_exit(rc))


def ps_task_of(rank: int, world_size: int, num_ps: int) -> int | None:
    """Which ps task global ``rank`` is (the last ``num_ps`` ranks are), or None for a trainer."""
    first = world_size - num_ps
    return rank - first if num_ps > 0 and rank >= first else None


def ps_task_lost(failure: Failed, task: int | None) -> Failed:
    """``failure`` (a ps task's exit) said as the end of the job under ``--elastic``."""
    return replace(failure, message=f"ps task {task} {failure.message}: the rows it held are gone, so the job "
                                    "cannot go on (--elastic heals replicas, not ps tasks)")
