"""Commands of the mission that later issues build; they say so and exit 2."""

from __future__ import annotations

import typer

from distrun.cli._app import app
from distrun.errors import UsageError

_PLANNED = {
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
