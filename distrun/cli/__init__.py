"""The `distrun` command line: one module per command; the only place that exits."""

from distrun.cli import bench, checkpoint, cluster, export, jobs, node, predict, stacks, train  # noqa: F401 - registers the commands
from distrun.cli._app import app, main, run

__all__ = ["app", "main", "run"]
