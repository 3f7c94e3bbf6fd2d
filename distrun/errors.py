"""One exception tree for all of distrun; only the CLI turns it into exit codes.

Every error carries the exit code the CLI uses for it, so the mapping lives in one
place and docs/cli.md can list it::

    DistrunError                 1  anything not classified below
    ├── UsageError               2  bad flags, a command not built yet
    │   └── ConfigError          2  invalid job or cluster spec (file, key path)
    ├── RecipeError              3  the recipe cannot be loaded or breaks the contract
    ├── TrainingError            4  a replica raised or died during training
    │   └── NonFiniteLoss        4  a NaN or Inf loss under --on-nonfinite stop (names the step and rank)
    ├── CheckpointError          5  no checkpoint to resume from, an unreadable one, one not written (a full disk)
    ├── HostError                6  a host cannot be reached, logged into or used
    │   ├── HostUnreachable      6  no connection or no login (the host's row says "down")
    │   └── HostKeyError         7  a host's SSH key is unknown or changed (refused)
    ├── Preempted               75  told the job would end (Slurm), it checkpointed and stopped
    └── Interrupted            130  Ctrl-C (SIGINT) or SIGTERM stopped the job

Messages are one line and name the file, key, rank or host they are about; the
traceback, when there is one, rides along in ``detail`` and is shown only with
``--debug``.
"""

from __future__ import annotations

__all__ = [
    "DistrunError",
    "UsageError",
    "ConfigError",
    "RecipeError",
    "TrainingError",
    "NonFiniteLoss",
    "PsTaskLost",
    "CheckpointError",
    "HostError",
    "HostUnreachable",
    "HostKeyError",
    "Preempted",
    "Interrupted",
    "EXIT_CODES",
]


class DistrunError(Exception):
    """Base of every error distrun raises on purpose."""

    exit_code: int = 1

    def __init__(self, message: str, *, detail: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class UsageError(DistrunError):
    """The command line asks for something that cannot be done."""

    exit_code = 2


class ConfigError(UsageError):
    """A spec (job flags, cluster file) is invalid; the message names where."""

    exit_code = 2


class RecipeError(DistrunError):
    """The recipe does not import, or defines only part of a contract."""

    exit_code = 3


class TrainingError(DistrunError):
    """A replica failed while training; the message names the first failing rank."""

    exit_code = 4

    def __init__(self, message: str, *, rank: int | None = None, detail: str | None = None,
                 stderr_tail: tuple[str, ...] = ()) -> None:
        super().__init__(message, detail=detail)
        self.rank = rank
        self.stderr_tail = stderr_tail  # the failing rank's last stderr lines, shown above the message


class NonFiniteLoss(TrainingError):
    """A replica's loss was NaN or Inf, and ``--on-nonfinite stop`` (the default) stops the job."""


class PsTaskLost(TrainingError):
    """A worker's connection to a ps task broke: a consequence of that task's loss, which the job's
    failure names first where it is known (its exit, or its host's)."""


class CheckpointError(DistrunError):
    """A checkpoint could not be found, read or written."""

    exit_code = 5


class HostError(DistrunError):
    """A host could not be reached, authenticated to, or lacks what distrun needs there.

    ``host`` is the address as the cluster file spells it; the message starts with it.
    """

    exit_code = 6

    def __init__(self, host: str, message: str, *, detail: str | None = None) -> None:
        super().__init__(f"{host}: {message}", detail=detail)
        self.host = host
        self.reason = message


class HostUnreachable(HostError):
    """No SSH connection or no login: the host is down as far as distrun can tell."""


class HostKeyError(HostError):
    """A host presented an SSH key that known_hosts does not hold, or a different one.

    Its own exit code, because a changed key may mean an attack: scripts should stop.
    """

    exit_code = 7


class Preempted(DistrunError):
    """The scheduler warned that the job's hosts will go (a Slurm time limit or preemption):
    every rank wrote its part of a checkpoint at one step and stopped. BSD's EX_TEMPFAIL."""

    exit_code = 75


class Interrupted(DistrunError):
    """The user interrupted the job; every replica was stopped."""

    exit_code = 130


EXIT_CODES: dict[str, int] = {
    cls.__name__: cls.exit_code
    for cls in (DistrunError, UsageError, ConfigError, RecipeError, TrainingError, CheckpointError, HostError,
                HostUnreachable, HostKeyError, Preempted, Interrupted)
}
