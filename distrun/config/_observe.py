"""What a job is asked to show of itself: ``--profile`` and ``--tracker``, parsed and checked.

Parsed here, in the control plane, so a bad flag fails before anything starts; applied in the
training processes (``runtime/_profile.py``, ``runtime/tracking/``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from distrun.config._suggest import did_you_mean
from distrun.errors import ConfigError

__all__ = ["TRACKERS", "parse_profile", "parse_tracker_uris", "check_trackers", "check_spec_trackers"]

#: ``--tracker``: the experiment trackers rank 0 can log to.
TRACKERS = ("mlflow", "wandb", "tensorboard")


def parse_profile(text: str) -> tuple[int, int]:
    """``--profile START:END`` as the inclusive window of global steps (``STEP`` alone: one step)."""
    head, sep, tail = str(text).partition(":")
    try:
        start = int(head)
        end = int(tail) if sep else start
    except ValueError:
        raise ConfigError(f"--profile: expected START:END global steps (e.g. 10:12). Received: {text!r}") from None
    check_profile((start, end))
    return start, end


def check_profile(window: tuple[int, int] | None, steps: int | None = None) -> None:
    """``steps``: the job's step count, where known (a window past it would never open)."""
    if window is None:
        return
    if len(window) != 2 or not all(isinstance(step, int) and not isinstance(step, bool) for step in window):
        raise ConfigError(f"--profile: expected two whole steps START:END. Received: {window!r}")
    start, end = window
    if not 1 <= start <= end:
        raise ConfigError(f"--profile {start}:{end}: needs 1 <= START <= END (global steps, the first is 1)")
    if steps is not None and start > steps:
        raise ConfigError(f"--profile {start}:{end}: the job takes {steps} step(s), so the window would never open")


def parse_tracker_uris(values: Iterable[str], trackers: Iterable[str]) -> dict[str, str]:
    """``--tracker-uri [NAME=]URI`` (repeatable) as {tracker: uri}; a bare URI needs one tracker."""
    trackers = tuple(trackers)
    uris: dict[str, str] = {}
    for value in values:
        name, sep, uri = str(value).partition("=")
        if not sep or name not in TRACKERS:  # "sqlite:///x.db?a=b" is a bare URI, not NAME=URI
            if len(trackers) != 1:
                raise ConfigError(f"--tracker-uri {value}: with {len(trackers)} trackers, name the one it is for "
                                  f"(--tracker-uri mlflow=URI)" if trackers else
                                  f"--tracker-uri {value}: needs --tracker mlflow|wandb|tensorboard")
            name, uri = trackers[0], str(value)
        if not uri:
            raise ConfigError(f"--tracker-uri {value}: empty URI")
        if name in uris:
            raise ConfigError(f"--tracker-uri: given twice for {name}")
        uris[name] = uri
    return uris


def check_trackers(trackers: tuple[str, ...], uris: Mapping[str, str], *, run_name: str | None,
                   experiment: str | None, log_checkpoint: bool, checkpoint_dir: str | None) -> None:
    """The tracker flags together, as given (``tensorboard`` included): known names, each once,
    a URI only for a tracker in use, the run's name and experiment only with a tracker."""
    flags = [flag for flag, used in (("--run-name", run_name is not None), ("--experiment", experiment is not None),
                                     ("--tracker-checkpoint", log_checkpoint)) if used]
    if flags and not trackers:
        raise ConfigError(f"{flags[0]} needs --tracker mlflow|wandb|tensorboard")
    check_spec_trackers(trackers, uris, log_checkpoint=log_checkpoint, checkpoint_dir=checkpoint_dir)


def check_spec_trackers(trackers: tuple[str, ...], uris: Mapping[str, str], *, log_checkpoint: bool,
                        checkpoint_dir: str | None) -> None:
    """What a JobSpec's trackers must hold (TensorBoard is its own folder there, not a tracker)."""
    _check_names(trackers, uris)
    if log_checkpoint:
        if not checkpoint_dir:
            raise ConfigError("--tracker-checkpoint needs --checkpoint-dir: it logs the newest checkpoint written there")
        if not set(trackers) & {"mlflow", "wandb"}:
            raise ConfigError("--tracker-checkpoint: TensorBoard keeps no artifacts; use --tracker mlflow or wandb")


def _check_names(trackers: tuple[str, ...], uris: Mapping[str, str]) -> None:
    for name in trackers:
        if name not in TRACKERS:
            raise ConfigError(f"--tracker: unknown tracker {name!r}{did_you_mean(str(name), TRACKERS)}; "
                              f"choose {', '.join(TRACKERS)}")
    if len(set(trackers)) != len(trackers):
        raise ConfigError(f"--tracker: each tracker once. Received: {', '.join(trackers)}")
    stray = sorted(set(uris) - set(trackers))
    if stray:
        raise ConfigError(f"--tracker-uri {stray[0]}=...: needs --tracker {stray[0]}")
