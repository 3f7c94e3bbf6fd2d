"""A local job's debug folder: where its ranks' error files and a hang's Flight Recorder dumps go.

It lives in the temporary folder, named by the job (``distrun-debug-local-<date>-<time>-<pid>-<n>``).
The launcher removes the error files and the folder when the job ends with nothing dumped in it. A
`distrun train` that was killed (SIGKILL, the OOM killer) cannot; the next local job of the same user
removes such a folder once its process is gone, unless a dump in it is still worth reading.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

from distrun.protocol.environment import ERROR_FILE_PREFIX

__all__ = ["debug_dir_of", "sweep_stale_debug_dirs"]

_PREFIX = "distrun-debug-"
_LOCAL = re.compile(r"distrun-debug-local-\d{8}-\d{6}-(?P<pid>\d+)-\d+")


def debug_dir_of(run_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"{_PREFIX}{run_id}")


def sweep_stale_debug_dirs(folder: str | None = None) -> list[str]:
    """Remove this user's local debug folders whose `distrun train` is gone and that hold nothing but
    error files (a dump stays for the user to read); the paths removed."""
    folder = folder or tempfile.gettempdir()
    removed = []
    uid = os.getuid()
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            match = _LOCAL.fullmatch(entry.name)
            if match is None or _alive(int(match["pid"])):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != uid or not entry.is_dir(follow_symlinks=False):
                    continue
                if all(name.startswith(ERROR_FILE_PREFIX) for name in os.listdir(entry.path)):
                    shutil.rmtree(entry.path)
                    removed.append(entry.path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds that pid now
        return True
    return True
