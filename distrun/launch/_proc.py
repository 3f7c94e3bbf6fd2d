"""One training process as the launcher tracks it, and how its exit reads."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from distrun.launch._lines import LineBuffer
from distrun.launch._starter import Handle
from distrun.protocol.environment import CUT_OFF_EXIT_CODE

__all__ = ["Proc", "describe_exit"]


@dataclass
class Proc:
    local_rank: int
    rank: int
    popen: Handle  # a subprocess.Popen, or a process the warm interpreter forked
    fds: dict[int, tuple[str, LineBuffer]] = field(default_factory=dict)
    returncode: int | None = None
    signalled: bool = False  # we sent it SIGTERM/SIGKILL: its death is ours, not its own failure
    lost_reason: str | None = None  # --elastic: why we killed it as lost (a hang), said when it is started again
    incarnation: int = 0  # how many times this rank was started before this process
    diagnose_w: int | None = None  # write end of its diagnose pipe: a byte asks for its Flight Recorder


def describe_exit(returncode: int) -> str:
    if returncode == CUT_OFF_EXIT_CODE:  # --elastic: the rank said so before it left
        return "cut off from the job's store: its link was down longer than TCP waits"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with code {returncode}"
