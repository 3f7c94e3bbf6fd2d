"""Shared helpers: run the real CLI in a subprocess, find leftover training processes."""

from __future__ import annotations

import compileall
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile distrun's bytecode once, before the hundreds of processes the suite starts (CLIs,
    servers, ranks) import it. Where the environment sets PYTHONDONTWRITEBYTECODE (this
    project's machines do) none of them writes a cache, so each compiled every module it
    imported again: `import distrun.cli._app` took 1.3 s that way against 0.4 s from the cache."""
    import distrun  # the package the processes import: the checkout, or an installed one

    compileall.compile_dir(str(Path(distrun.__file__).parent), quiet=2)


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float

    def json_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]

    @property
    def summary(self) -> dict:
        lines = self.json_lines()
        assert lines and lines[-1]["type"] == "summary", self.stdout[-2000:] + self.stderr[-2000:]
        return lines[-1]


def run_cli(*args: str, timeout: float = 240, env: dict[str, str] | None = None) -> CliResult:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "distrun", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)


def interrupt(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """Ctrl-C for a process a test started (a job's `distrun train`, a dashboard), then its end;
    killed if it does not end within ``timeout_s``, so that a test's end never leaves it running."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def training_processes(marker: str) -> list[psutil.Process]:
    """Live training processes whose job spec mentions ``marker`` (a unique tmp path)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if "distrun.runtime" not in cmd and marker not in cmd:
                continue
            if marker in cmd or marker in proc.environ().get("DISTRUN_JOB_SPEC", ""):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_no_processes(marker: str, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        left = training_processes(marker)
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"training processes left behind: {[p.pid for p in left]}")
        time.sleep(0.1)


@pytest.fixture
def write_recipe(tmp_path: Path) -> Callable[[str, str], Path]:
    def write(source: str, name: str = "recipe.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


#: How long a fresh local server's warm interpreter may take to import torch and the strategies.
WARM_WAIT_S = 60.0


@contextlib.contextmanager
def local_server(home: Path) -> Iterator[dict[str, str]]:
    """`distrun up` (no file) in its own DISTRUN_HOME, once its warm interpreter is ready; its env
    for run_cli. `distrun down` after."""
    env = {"DISTRUN_HOME": str(home)}
    up = run_cli("up", "--json", env=env)
    assert up.returncode == 0, up.stderr[-2000:]
    try:
        deadline = time.monotonic() + WARM_WAIT_S
        while True:
            status = run_cli("status", "--json", env=env)
            server = json.loads(status.stdout)["hosts"][0]["server"] if status.returncode == 0 else None
            if server and server["warm"]:
                break
            assert time.monotonic() < deadline, f"no warm interpreter after {WARM_WAIT_S:.0f} s: {status.stderr}"
            time.sleep(0.3)
        yield env
    finally:
        run_cli("down", env=env)


@contextlib.contextmanager
def warm_module(factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Every `distrun train` of a module starts warm, as a user's after `distrun up`: its ranks are
    forked from a warm interpreter instead of importing torch (a 4-rank job here: 4 s against 14).
    For the modules whose many jobs would otherwise spend most of the suite's time importing; the
    cold path stays under test everywhere else, and the two give the same parameters bit for bit
    (test_warm_local)."""
    with local_server(factory.mktemp("distrun-home")) as env:
        before = os.environ.get("DISTRUN_HOME")
        os.environ["DISTRUN_HOME"] = env["DISTRUN_HOME"]  # run_cli passes os.environ on
        try:
            yield env
        finally:
            if before is None:
                os.environ.pop("DISTRUN_HOME", None)
            else:
                os.environ["DISTRUN_HOME"] = before
