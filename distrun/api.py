"""distrun from Python: ``distrun.train(recipe, **options)`` and ``distrun.Cluster(path)``.

A sweep, a notebook or a scheduler wants a call, not a shell line. ``train`` takes every option
of ``distrun train`` by its flag's long name with underscores (``checkpoint_dir=``,
``global_batch_size=``, ``replicas=``, ``cluster=``), or whole sections of a job file as dicts
(``checkpoint={"dir": "ckpt", "every": 10}``; ``strategy="mirrored"`` is ``strategy.name``). It
runs the very command ``distrun train`` runs, so every option is checked and means what it
means on the command line, and returns the summary the command prints (``JobSummary``: the
``--json`` summary's fields as attributes). A failure raises distrun's own error class, the
one whose exit code the command would have ended with.

Progress renders as the live table in a terminal, as a table updated in place in a Jupyter
cell (the saved notebook keeps it and the summary), or not at all with ``progress=False``.
Importing ``distrun`` stays cheap and never imports torch: this module loads on first use.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import typer

from distrun.cli import app
from distrun.cli._app import ClickErrors, usage_line
from distrun.cli._job_file import GIVEN
from distrun.cli._run import NOTEBOOK, QUIET, TERMINAL, rendered_as
from distrun.cli.cluster import load_cluster_file
from distrun.client import cluster_down, cluster_status, cluster_up
from distrun.config.job_file import SECTIONS
from distrun.config._suggest import did_you_mean
from distrun.errors import DistrunError, HostError, Interrupted, UsageError
from distrun.protocol import JobSummary
from distrun.protocol.cluster import ClusterReport

__all__ = ["train", "Cluster", "JobSummary"]

#: Options that say how the command prints or returns, not what the job is: the API decides those
#: (``distrun.train`` waits for the job and returns its summary: never detached).
_NOT_OPTIONS = ("json", "debug", "print_config", "detach", "help")
#: What the API always says of those, over any file's ``job:`` or ``--config``.
_DECIDED = frozenset({"json_output", "debug", "print_config", "detach"})
_SECTIONS = {section.name: section for section in SECTIONS}


def train(recipe: str | Path, *, progress: bool = True, **options: Any) -> JobSummary:
    """Train ``recipe`` as ``distrun train`` would with these options; return its summary.

    ``options``: flags by their long name with underscores (``steps=30``, ``cluster="lab.yaml"``,
    ``compile=True``, ``tracker=["mlflow"]``), sections as dicts (``training={"steps": 30}``), and
    ``args=[...]`` for the recipe's own arguments (``-- ARGS``). ``progress=False``: print nothing.
    """
    command = typer.main.get_command(app)  # not app(): that would set sys.excepthook for the process
    argv, given = _argv(options, command.commands["train"])  # type: ignore[attr-defined]
    mode = QUIET if not progress else NOTEBOOK if _in_notebook() else TERMINAL
    token = GIVEN.set(given | _DECIDED)
    try:
        with rendered_as(mode):
            summary = command.main(["train", str(recipe), *argv], prog_name="distrun", standalone_mode=False)
    except typer.Abort:  # a Ctrl-C before the job started (click's word for it)
        raise Interrupted("interrupted") from None
    except ClickErrors as exc:
        raise UsageError(usage_line(exc).replace("distrun train: ", "distrun.train: ", 1)) from None
    finally:
        GIVEN.reset(token)
    if not isinstance(summary, JobSummary):
        raise DistrunError("distrun.train: the job ended without a summary")
    return summary


class Cluster:
    """A cluster file (None: this machine's embedded server), as `distrun up/status/down` use it."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None

    def up(self, *, setup: bool = True) -> ClusterReport:
        """Start a worker server on every host (healthy ones are kept); HostError if a host is not up."""
        return _checked(cluster_up(load_cluster_file(self.path), run_setup=setup), "up")

    def status(self) -> ClusterReport:
        """Every host's server as it is now (the report says which are not up; nothing raises for that)."""
        return cluster_status(load_cluster_file(self.path))

    def down(self) -> ClusterReport:
        """Stop every job and server; HostError if a host is not left clean."""
        return _checked(cluster_down(load_cluster_file(self.path)), "clean")

    def train(self, recipe: str | Path, **options: Any) -> JobSummary:
        """``distrun.train(recipe, cluster=this file, **options)``."""
        if self.path is None:
            return train(recipe, **options)
        return train(recipe, cluster=self.path, **options)

    def __repr__(self) -> str:
        return f"Cluster({str(self.path) if self.path else 'this machine'!r})"


def _checked(report: ClusterReport, wanted: str) -> ClusterReport:
    if not report.ok:
        bad = [row for row in report.rows if row.exit_code or not row.status.healthy] or list(report.rows)
        names = ", ".join(f"{row.host} ({row.status.value})" for row in bad)
        raise HostError(bad[0].host, f"{len(bad)} of {len(report.rows)} host(s) not {wanted}: {names}")
    return report


def _argv(options: Mapping[str, Any], train: Any) -> tuple[list[str], frozenset[str]]:
    """The command line these options mean to ``train`` (the click command; sections spread into
    their flags), and the train parameters they name (given outright: over any file, a False or
    [] too). Options go by the flag's long name with underscores (``--cluster``: cluster)."""
    params = {_name(param): param for param in train.params if param.param_type_name == "option"}
    flag_of = {param.name: name for name, param in params.items()}  # the train parameter -> its flag's name
    flat: dict[str, Any] = {}
    recipe_args: Sequence[Any] = ()
    for name, value in options.items():
        if isinstance(value, Mapping) and name in _SECTIONS:  # checkpoint={"dir": ...}
            section = _SECTIONS[name]
            for key, item in value.items():
                param = section.keys.get(str(key).replace("-", "_"))
                if param is None:
                    raise UsageError(f"distrun.train: {name}[{key!r}]: no such key{did_you_mean(str(key), section.keys)}; "
                                     f"keys of {name}: {', '.join(section.keys)}")
                if param == "recipe_args":
                    recipe_args = item
                    continue
                flat[flag_of[param]] = item
        elif name == "args":
            recipe_args = value
        elif name in params and name not in _NOT_OPTIONS:
            flat[name] = value
        else:
            known = [*(n for n in params if n not in _NOT_OPTIONS), *_SECTIONS, "args", "progress"]
            raise UsageError(f"distrun.train: no option {name!r}{did_you_mean(name, known)}")
    argv: list[str] = []
    for name, value in flat.items():
        argv += _tokens(params[name], value)
    given = {str(params[name].name) for name, value in flat.items() if value is not None}
    if recipe_args:
        if isinstance(recipe_args, (str, bytes)) or not isinstance(recipe_args, Sequence):
            raise UsageError(f"distrun.train: args: expected a list of the recipe's arguments. Received: {recipe_args!r}")
        argv += ["--", *(str(item) for item in recipe_args)]
        given.add("recipe_args")
    return argv, frozenset(given)


def _tokens(param: Any, value: Any) -> list[str]:
    flag = max(param.opts, key=len)
    if value is None:
        return []
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, Mapping) and param.multiple:  # tracker_uri={"mlflow": "sqlite:///m.db"}
        value = [f"{key}={item}" for key, item in value.items()]
    if param.is_flag:
        if not isinstance(value, bool):
            raise UsageError(f"distrun.train: {_name(param)}: expected True or False. Received: {value!r}")
        if value:
            return [flag]
        return [max(param.secondary_opts, key=len)] if param.secondary_opts else []
    if param.multiple:
        items = [value] if isinstance(value, (str, Path)) or not isinstance(value, Sequence) else list(value)
        return [token for item in items for token in (flag, str(item))]
    if isinstance(value, (list, tuple, dict, set)):
        raise UsageError(f"distrun.train: {_name(param)}: expected one value (as {flag} takes). Received: {value!r}")
    return [flag, str(value)]


def _name(param: Any) -> str:
    return max(param.opts, key=len).lstrip("-").replace("-", "_")


def _in_notebook() -> bool:
    """Running in a Jupyter kernel (IPython with a kernel attached), where a cell shows the output."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython() if hasattr(ipython, "get_ipython") else None
    return shell is not None and getattr(shell, "kernel", None) is not None
