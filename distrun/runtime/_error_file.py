"""torchrun's per-rank error file (TORCHELASTIC_ERROR_FILE), and reading what it says.

``torch.distributed.elastic.multiprocessing.errors.record`` writes the exception of the
function it wraps to the file that ``TORCHELASTIC_ERROR_FILE`` names, as JSON. torchrun's
agent sets one per worker, and so does distrun, one per rank, before the recipe runs.
Children the script starts inherit the variable. When a rank exits non-zero without an
exception distrun saw (a script that exits with its child's code, say), the file is what
says why. The rank's own exceptions are caught by the runtime itself, file and line
included.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from typing import Any

from distrun.protocol import Failed
from distrun.protocol.environment import ERROR_FILE_VAR

__all__ = ["ERROR_FILE_VAR", "prepare_error_file", "recorded_failure", "remove_error_file"]

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def prepare_error_file(rank: int) -> str:
    """Name a fresh, empty error file for this rank and export it. A launcher that names one (distrun's:
    in its debug folder, which it clears when the job ends, however its ranks ended) keeps it; a
    stale file there, from a rank that held the place before (an elastic respawn), is removed."""
    if os.environ.get(ERROR_FILE_VAR):
        path = os.environ[ERROR_FILE_VAR]
        with contextlib.suppress(OSError):
            os.remove(path)
        return path
    folder = tempfile.mkdtemp(prefix=f"distrun-rank{rank}-")
    path = os.path.join(folder, "error.json")
    os.environ[ERROR_FILE_VAR] = path
    atexit.register(remove_error_file, path)  # a failing rank leaves by os._exit: it removes it itself
    return path


def remove_error_file(path: str) -> None:
    """Remove the file and, if distrun made it, its folder."""
    folder = os.path.dirname(path)
    if os.path.basename(folder).startswith("distrun-rank"):
        shutil.rmtree(folder, ignore_errors=True)


def recorded_failure(path: str, *, rank: int, step: int | None) -> Failed | None:
    """The Failed event the error file describes; None if there is none, or it is not torch's JSON."""
    try:
        with open(path, encoding="utf-8") as handle:
            data: Any = json.load(handle)
    except (OSError, ValueError, RecursionError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        text = message.get("message")
        extra = message.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
    else:
        text, stack = message, None
    if not isinstance(text, str) or not text:
        return None
    frames = _FRAME.findall(stack) if isinstance(stack, str) else []
    file, line = (frames[-1][0], int(frames[-1][1])) if frames else (None, None)
    return Failed(rank=rank, time=time.time(), kind="raised", message=text, file=file, line=line, step=step,
                  traceback=stack if isinstance(stack, str) else "")
