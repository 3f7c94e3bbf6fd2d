"""The server's warm interpreter: one zygote per server, started in the background.

The server itself never imports torch (a broken CUDA install must not take it
down); the zygote does, in a process of its own. If the zygote cannot start
(torch missing or broken) or dies, jobs start cold, as with torchrun; nothing
else changes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

from distrun.launch import Starter, ZygoteStarter

log = logging.getLogger("distrun.server.warm")


class WarmInterpreter:
    def __init__(self, folder: Path) -> None:
        self.socket_path = str(folder / "zygote.sock")
        self._proc: subprocess.Popen[bytes] | None = None
        self._starter: ZygoteStarter | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the zygote; it becomes usable once it has imported torch (a second or two)."""
        argv = [sys.executable, "-u", "-m", "distrun.launch._zygote", self.socket_path, "--parent", str(os.getpid())]
        with self._lock:
            self._starter = None
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        threading.Thread(target=self._await_ready, args=(self._proc,), name="zygote-ready", daemon=True).start()

    def _await_ready(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        proc.stdout.close()
        try:
            ready = json.loads(line.decode())
        except ValueError:
            log.warning("the warm interpreter did not start (exit %s); jobs start cold", proc.wait())
            return
        with self._lock:
            if proc is self._proc and ready.get("ready"):
                self._starter = ZygoteStarter(self.socket_path, int(ready["pid"]))
                log.info("warm interpreter ready (pid %s)", ready["pid"])

    def starter(self) -> Starter | None:
        """The zygote if it is up; None means "start cold". A dead zygote is restarted for next time."""
        with self._lock:
            proc, starter = self._proc, self._starter
        if proc is not None and proc.poll() is not None:
            log.warning("the warm interpreter exited (%s); restarting it", proc.returncode)
            self.start()
            return None
        return starter

    @property
    def ready(self) -> bool:
        """For `status`: is the zygote up? (Reading it never restarts it; ``starter()`` does.)"""
        with self._lock:
            return self._starter is not None and self._proc is not None and self._proc.poll() is None

    def describe(self) -> dict[str, object]:
        """How a client on this host forks from the zygote itself (a warm local `distrun train`):
        its socket (0600, in the server's 0700 folder), its pid (what the ranks' parent will be)
        and the interpreter it runs, which the client must share."""
        with self._lock:
            alive = self._proc is not None and self._proc.poll() is None
            starter = self._starter if alive else None
        if starter is None:  # starting: still importing torch (a client right after `up` waits for it)
            return {"ready": False, "starting": alive}
        return {"ready": True, "socket": starter.socket_path, "pid": starter.zygote_pid, "python": sys.executable}

    def stop(self) -> None:
        with self._lock:
            proc = self._proc
            self._proc, self._starter = None, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
