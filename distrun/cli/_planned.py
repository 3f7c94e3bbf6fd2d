"""Commands of the mission that later issues build; they say so and exit 2."""

from __future__ import annotations

import typer

from distrun.cli._app import app
from distrun.errors import UsageError

_PLANNED = {
    "up": ("SSH to the hosts of a cluster file and start worker servers", "cluster (issue 3)"),
    "down": ("Stop every job and worker server of a cluster", "cluster (issue 3)"),
    "status": ("Show the cluster's hosts, servers and jobs", "cluster (issue 3)"),
    "jobs": ("List jobs on a cluster", "standalone client (issue 4)"),
    "attach": ("Replay and follow a running job", "standalone client (issue 4)"),
    "logs": ("Print per-rank logs of a job", "standalone client (issue 4)"),
    "cancel": ("Cancel a job on every host", "standalone client (issue 4)"),
}


def _register(name: str, summary: str, planned_in: str) -> None:
    def command(ctx: typer.Context) -> None:
        raise UsageError(f"`distrun {name}` is not built yet (planned: {planned_in})")

    command.__doc__ = f"{summary} (not built yet: {planned_in})."
    app.command(
        name=name,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(command)


for _name, (_summary, _where) in _PLANNED.items():
    _register(_name, _summary, _where)
