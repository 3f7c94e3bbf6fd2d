"""The `distrun` command line: one module per command; the only place that exits."""

import sys

# paramiko imports invoke (with asyncio and unittest.mock: 40 ms of every command) only to run an
# ssh_config's "Match exec"; distrun reads no ssh_config through paramiko. An invoke already
# imported is left alone.
sys.modules.setdefault("invoke", None)  # type: ignore[arg-type]

from distrun.cli import bench, checkpoint, cluster, export, jobs, node, stacks, train  # noqa: F401 - registers the commands
from distrun.cli._app import app, main, run

__all__ = ["app", "main", "run"]
