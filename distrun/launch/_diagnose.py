"""Looking inside running ranks without stopping them: ``distrun stacks`` and ``--hang-timeout-s``.

py-spy reads each rank's stack (``launch/_pyspy``), and a byte on each rank's diagnose pipe
asks it for its Flight Recorder (``runtime/_flight_recorder``). Any thread may ask (a server
request, the client's hang watch); the launcher's own thread closes a pipe when its rank
exits, so the pipes are written and closed under one lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from distrun.launch._proc import Proc
from distrun.launch._pyspy import StackUnavailable, read_stack
from distrun.protocol.diagnosis import RankStack, flight_recorder_file
from distrun.protocol.environment import ERROR_FILE_PREFIX

__all__ = ["RankDiagnosis"]


class RankDiagnosis:
    """The stacks and Flight Recorders of the ranks ``running()`` returns."""

    def __init__(self, running: Callable[[], list[Proc]], debug_dir: str | None) -> None:
        self._running = running
        self._debug_dir = debug_dir
        self._lock = threading.Lock()  # a diagnose pipe is written from any thread, closed by the launcher's

    def stacks(self, *, native: bool = False, host: str = "") -> list[RankStack]:
        """Every running rank's main-thread stack now, read by py-spy (one at a time: each
        read pauses its rank for a moment); a rank py-spy cannot read says why."""
        found = []
        for proc in sorted(self._running(), key=lambda p: p.rank):
            pid = proc.popen.pid
            try:
                found.append(RankStack(rank=proc.rank, host=host, pid=pid, frames=read_stack(pid, native=native)))
            except StackUnavailable as exc:
                found.append(RankStack(rank=proc.rank, host=host, pid=pid, error=str(exc)))
        return found

    def dump_flight_recorder(self, timeout_s: float = 10.0) -> dict[int, str]:
        """Ask every running rank for its Flight Recorder; {rank: the dump's path} for the dumps
        written within ``timeout_s`` (a rank stuck holding the GIL writes none). Thread-safe."""
        folder = self._debug_dir
        if folder is None:
            return {}
        asked: dict[int, str] = {}
        with self._lock:
            for proc in self._running():
                path = os.path.join(folder, flight_recorder_file(proc.rank))
                try:
                    os.unlink(path)  # an older dump must not pass for this one
                except FileNotFoundError:
                    pass
                if proc.diagnose_w is None:
                    continue
                try:
                    os.write(proc.diagnose_w, b"d")
                except OSError:  # it exited, or its pipe is full of unanswered asks
                    continue
                asked[proc.rank] = path
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(os.path.exists(p) for p in asked.values()):
            time.sleep(0.05)
        return {rank: path for rank, path in asked.items() if os.path.exists(path)}

    def answer(self, *, native: bool, flight_recorder: bool, host: str = "") -> dict[str, Any]:
        """``distrun stacks``' answer for these ranks, as a worker server sends it: every stack, and
        with ``flight_recorder`` the paths of the dumps ({rank: path}, dumped first: the ring as it
        was when asked), which the client reads."""
        dumps = self.dump_flight_recorder() if flight_recorder else {}
        return {"stacks": [dataclasses.asdict(stack) for stack in self.stacks(native=native, host=host)],
                "dumps": {str(rank): path for rank, path in dumps.items()}}

    def close(self, proc: Proc) -> None:
        """Its rank exited: no one asks it again."""
        with self._lock:  # never closed while another thread writes to it
            if proc.diagnose_w is not None:
                os.close(proc.diagnose_w)
                proc.diagnose_w = None

    def close_all(self, procs: list[Proc]) -> None:
        """Every pipe, and the debug folder if nothing was dumped in it."""
        for proc in procs:
            self.close(proc)
        folder = self._debug_dir
        if folder:
            with contextlib.suppress(OSError):  # the ranks' error files: read by each rank as it failed
                for name in os.listdir(folder):
                    if name.startswith(ERROR_FILE_PREFIX):
                        os.remove(os.path.join(folder, name))
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only if nothing was dumped: an empty folder tells nobody anything
