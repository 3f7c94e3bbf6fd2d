"""Checkpoint and stop when told the job will end: Slurm's warning before a time limit or a preemption.

Slurm sends SIGUSR1 (``--signal=B:USR1@N`` to the batch script, which hands it on,
or to the steps at a preemption with ``PreemptParameters=send_user_signal``) some
seconds before it kills the job. The signal reaches each rank at its own moment,
in the middle of some step, so a rank only notes it; after every step the
replicas agree (an all-reduce of one flag, MAX: one rank told is enough), and at
that step each writes its part of a checkpoint and stops with exit code 75.
The check costs one scalar all-reduce per step, and only in a ``preemptible`` job.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

__all__ = ["PreemptWatch", "Preempted", "install_preempt_handler"]

_asked = False


class Preempted(Exception):
    """The replicas agreed to stop at ``step``; its checkpoint is written."""

    def __init__(self, step: int, checkpoint: bool) -> None:
        super().__init__(f"stopped at step {step} to be requeued")
        self.step = step
        self.checkpoint = checkpoint


def _note(signum: int, frame: FrameType | None) -> None:
    global _asked
    _asked = True


def install_preempt_handler() -> None:
    """From the rank's first moments: a SIGUSR1 before training starts is kept, not fatal. Every
    rank installs it: on Slurm the warning reaches every process of the step, and a job that
    is not preemptible (no checkpoint folder) goes on to the end it was warned of."""
    signal.signal(signal.SIGUSR1, _note)


class PreemptWatch:
    """After each step: did any replica hear that the job will end?"""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def agreed(self, strategy: Any) -> bool:
        if not self.enabled:
            return False
        # Over every rank, not one per replica: under --tp/--pp each rank of a replica must stop too.
        return bool(strategy._any_true(_asked))
