"""A running rank's Python stack, read from outside by py-spy (``distrun stacks``).

py-spy reads the interpreter's memory (ptrace), so it sees a rank that is stuck: blocked
in a collective, in C code, or in a loop that never yields. It briefly pauses the process
while it reads, and needs no cooperation from it. It is a dependency of distrun (a wheel
with its binary), found next to this interpreter first, then on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from distrun.protocol.diagnosis import Frame

__all__ = ["py_spy", "read_stack", "StackUnavailable"]

#: How long one py-spy dump may take (it reads a few pages of memory; --native unwinds too).
DUMP_TIMEOUT_S = 20.0


class StackUnavailable(Exception):
    """py-spy could not read the process; the message says why, in one line."""


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def read_stack(pid: int, *, native: bool = False, timeout_s: float = DUMP_TIMEOUT_S) -> tuple[Frame, ...]:
    """The main thread's frames, innermost first (``native``: C/C++ frames too)."""
    binary = py_spy()
    if binary is None:
        raise StackUnavailable("py-spy not found beside this Python or on PATH: pip install py-spy")
    argv = [binary, "dump", "--json", "--pid", str(pid)] + (["--native"] if native else [])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise StackUnavailable(f"py-spy gave no stack within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise StackUnavailable(_last_line(done.stderr or done.stdout) or f"py-spy exited {done.returncode}")
    try:
        threads = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise StackUnavailable("py-spy's answer is not JSON") from None
    return main_thread_frames(threads)


def main_thread_frames(threads: object) -> tuple[Frame, ...]:
    """py-spy's ``dump --json`` (a list of threads) to the main thread's frames."""
    if not isinstance(threads, list) or not threads:
        raise StackUnavailable("py-spy found no Python thread")
    main = next((t for t in threads if isinstance(t, dict) and t.get("thread_name") == "MainThread"), threads[0])
    frames = []
    for raw in main.get("frames") or ():
        filename = str(raw.get("filename") or "")
        shown = str(raw.get("short_filename") or filename)
        frames.append(Frame(function=_function(str(raw.get("name") or "?")), file=shown,
                            line=int(raw.get("line") or 0), user=is_user_file(filename)))
    return tuple(frames)


#: A native frame's C++ name can run to a kilobyte of template arguments.
_MAX_FUNCTION_CHARS = 120


def _function(name: str) -> str:
    """A frame's name as a report shows it: a bare address (it differs between processes, so
    ranks stopped at the same place would not collapse) becomes ``??``; long names are cut."""
    if name.startswith("0x"):
        return "??"
    return name if len(name) <= _MAX_FUNCTION_CHARS else name[: _MAX_FUNCTION_CHARS - 1] + "…"


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.add(str(Path(__file__).resolve().parents[1]))  # distrun itself, wherever it is installed
    return tuple(sorted(root.rstrip(os.sep) + os.sep for root in roots))


_LIBRARY_ROOTS = _library_roots()


def is_user_file(filename: str) -> bool:
    """The job's own code: a real file outside the standard library, installed packages and distrun."""
    if not filename or filename.startswith("<") or not os.path.isabs(filename):
        return False  # <frozen ...>, <string>, native frames (a shared object's name)
    if filename.endswith((".so", ".so.6")) or ".so." in filename:
        return False
    return not any(filename.startswith(root) for root in _LIBRARY_ROOTS) and "site-packages" not in filename


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
