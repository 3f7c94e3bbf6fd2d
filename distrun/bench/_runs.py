"""Running one benchmark contender as a fresh command, and reading what it measured.

Shared by every benchmark (overhead, ttfs, scaling). Contenders print their
measurement as one JSON line with a ``bench`` key, either directly (torchrun
scripts) or wrapped in a distrun ``output`` event (the same line under
``distrun train --json``). Never imports torch.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from distrun.errors import DistrunError

HERE = Path(__file__).resolve().parent
#: The overhead workload as a hand-written torchrun + DDP script, and as a fit-style recipe.
DDP_SCRIPT = HERE / "_ddp_script.py"
FIT_RECIPE = HERE / "_overhead_recipe.py"
TIMEOUT_S = 900


def run_command(argv: list[str], env: dict[str, str]) -> tuple[float, list[dict[str, object]]]:
    """Run ``argv`` to its end; return when it started (wall clock) and the JSON lines it printed."""
    t0 = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=TIMEOUT_S, check=False)  # noqa: S603
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise DistrunError(f"benchmark command failed ({' '.join(argv[:4])} ...): " + " | ".join(tail))
    return t0, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def measurement(objects: list[dict[str, object]], bench: str) -> dict[str, object]:
    """The ``{"bench": bench, ...}`` line among a command's JSON lines (unwrapping output events)."""
    for obj in objects:
        line = obj.get("line") if obj.get("type") == "output" else None
        candidate = json.loads(line) if isinstance(line, str) and line.startswith("{") else obj
        if candidate.get("bench") == bench:
            return candidate
    raise DistrunError(f"the {bench} workload printed no measurement")
