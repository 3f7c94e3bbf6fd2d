"""The `distrun` command line: one module per command; the only place that exits."""

from distrun.cli import bench, checkpoint, cluster, export, jobs, node, plan, predict, stacks, train  # noqa: F401 - registers the commands
from distrun.cli import dashboard  # noqa: F401 - registers `distrun dashboard`
from distrun.cli._app import app, main, run

__all__ = ["app", "main", "run"]
