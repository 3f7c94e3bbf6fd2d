"""Turning an exception in a training process into a Failed event that names the recipe line."""

from __future__ import annotations

import os
import time
import traceback

from distrun.errors import DistrunError, PsTaskLost
from distrun.protocol import PEER_LOST, Failed

_PEER_LOST_HINTS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "connection reset",
    "Socket Timeout",
    "recvBytes",
    "NCCL communicator was aborted",
    # torch's own words under a gloo transport error from a peer that went away, whatever the
    # socket said first (seen on a 2-host job whose other rank was SIGKILLed):
    "typically caused by a remote worker crashing",
)


def describe_failure(exc: BaseException, *, rank: int, recipe: str, step: int | None, phase: str,
                     during: str | None = None) -> Failed:
    """``phase`` is "import" while the recipe module runs its top level, else "train"; ``during``:
    what the rank was doing outside a step ("building the model")."""
    file, line = getattr(exc, "recipe_location", None) or _recipe_frame(exc, recipe)
    if isinstance(exc, SyntaxError) and exc.filename:
        file, line = exc.filename, exc.lineno
    kind = _classify(exc, phase)
    message = exc.message if isinstance(exc, DistrunError) else f"{type(exc).__name__}: {_without_frames(str(exc))}"
    return Failed(
        rank=rank,
        time=time.time(),
        kind=kind,
        message=message,
        file=file,
        line=line,
        step=step,
        traceback="".join(traceback.format_exception(exc)),
        during=during,
    )


def _without_frames(text: str) -> str:
    """torch's C++ errors carry their C++ stack ("Exception raised from ... frame #0: ..."): the
    message is what precedes it (the traceback keeps the whole)."""
    head, _, _ = text.partition("\nException raised from ")
    return head.rstrip()


def _classify(exc: BaseException, phase: str) -> str:
    if isinstance(exc, PsTaskLost):  # the ps task's own loss is the cause (protocol/root_cause)
        return PEER_LOST
    if isinstance(exc, DistrunError):
        return type(exc).__name__
    text = str(exc)
    name = type(exc).__name__
    # DistNetworkError: the store's connection closed under the rank (its host, or the rank hosting it, went).
    if name in ("DistBackendError", "DistNetworkError") or any(h in text for h in _PEER_LOST_HINTS):
        return PEER_LOST
    return "import" if phase == "import" else "raised"


def _recipe_frame(exc: BaseException, recipe: str) -> tuple[str | None, int | None]:
    """The innermost frame inside the recipe's folder (the recipe or its siblings)."""
    folder = os.path.dirname(os.path.abspath(recipe))
    found: tuple[str | None, int | None] = (None, None)
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.dirname(os.path.abspath(frame.filename)) == folder:
            found = (frame.filename, frame.lineno)
    return found
