"""`distrun train --config job.yaml`, a cluster file's `job:` section and `--print-config`.

A command decorated with ``job_from_files`` gets, for every option the command line left at
its default, the value a file gives it. The precedence, highest first: the command line,
``--config``, the cluster file's ``job:``, then (inside the command, as before) the recipe's
``defaults``. A file's value goes through the option's own click type, so it means what the
flag means; a value of the wrong type is one line naming the file, the line and the key. An
error the command raises about a flag whose value came from a file (``--strategy: unknown
strategy 'mirorred'``) is told at that file's line too.

The decorator also puts each option in its help panel (``config/job_file.SECTIONS``), so the
help, the file and ``--print-config`` cannot drift apart.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import typer
import yaml

from distrun.config import load_cluster
from distrun.config.job_file import SECTIONS, JobOption, panel_of, read_job_file
from distrun.errors import ConfigError, DistrunError, UsageError

__all__ = ["job_from_files", "render_job", "GIVEN"]

#: How a value that is given on the command line (or in its environment variable) reads in click.
_GIVEN = ("COMMANDLINE", "ENVIRONMENT", "PROMPT")

Command = Callable[..., Any]
#: Options given outright by the Python API (``distrun.train``): they win over the files as the
#: command line does, a ``False`` or an empty list included (which no command-line token says).
GIVEN: ContextVar[frozenset[str]] = ContextVar("distrun_given_options", default=frozenset())
_WHOLE = ("integer", "int", "integer range")
_KINDS = {"integer": "a whole number", "int": "a whole number", "float": "a number", "boolean": "true or false",
          "text": "text", "path": "a path"}


def job_from_files(*, fill: Callable[[dict[str, Any]], dict[str, Any]],
                   failed: Callable[[BaseException, dict[str, Any]], None]) -> Callable[[Command], Command]:
    """``fill(params)``: the defaults the command itself would choose (strategy, the recipe's),
    for ``--print-config``; ``failed(error, params)``: report a failure before the command ran
    (``--json``'s failed summary)."""

    def decorate(command: Command) -> Command:
        signature = inspect.signature(command)
        for name, parameter in signature.parameters.items():
            info = parameter.default
            if isinstance(info, typer.models.OptionInfo) and info.rich_help_panel is None:
                info.rich_help_panel = panel_of(name)
        hints = typing.get_type_hints(command)

        @functools.wraps(command)
        def resolved(**params: Any) -> Any:
            ctx: typer.Context = params["ctx"]
            came_from: dict[str, JobOption] = {}
            try:
                _apply_files(ctx, params, hints, came_from)
                if params.get("print_config"):
                    typer.echo(render_job(fill(dict(params))), nl=False)
                    return None
            except DistrunError as exc:
                failed(exc, params)
                raise
            try:
                return command(**params)
            except UsageError as exc:
                raise _at_its_line(exc, ctx, came_from) from None

        return resolved

    return decorate


def _apply_files(ctx: typer.Context, params: dict[str, Any], hints: dict[str, Any],
                 came_from: dict[str, JobOption]) -> None:
    given = {name for name in params if name != "ctx" and _source(ctx, name) in _GIVEN} | GIVEN.get()
    by_name = {param.name: param for param in ctx.command.params}
    if params.get("config") is not None:
        _set(read_job_file(Path(params["config"])), ctx, params, hints, by_name, given, came_from)
    cluster_file = params.get("cluster_file")
    if cluster_file is not None:  # after --config, which may name it
        section = load_cluster(Path(cluster_file)).job
        moved = [option for option in section if option.param == "cluster_file"]
        if moved:
            raise ConfigError(f"{moved[0].where}: job.{moved[0].key}: a cluster file's job cannot name a cluster file")
        _set(section, ctx, params, hints, by_name, given, came_from)


def _set(options: tuple[JobOption, ...], ctx: typer.Context, params: dict[str, Any], hints: dict[str, Any],
         by_name: dict[str, Any], given: set[str], came_from: dict[str, JobOption]) -> None:
    for option in options:
        if option.param not in by_name:
            continue
        if option.value is None:  # null: distrun's default, as --print-config writes it
            continue
        value = _convert(ctx, by_name[option.param], option, hints.get(option.param))  # checked even if overridden
        if option.param in given or option.param in came_from:
            continue  # the command line wins; a higher file set it already
        params[option.param] = value
        came_from[option.param] = option


def _convert(ctx: typer.Context, param: Any, option: JobOption, hint: Any) -> Any:
    """``option``'s value as the flag would give it to the command (click's type, then typer's Path)."""
    value = option.value
    several = bool(getattr(param, "multiple", False)) or getattr(param, "nargs", 1) == -1
    if several and isinstance(value, (str, int, float)):
        value = [value]  # one include, one tracker
    if several and not isinstance(value, list) or several and any(isinstance(item, (dict, list)) for item in value):
        raise ConfigError(f"{option.where}: {option.key}: expected a list of values (as {_flag(param)} takes, once "
                          f"each). Received: {value!r}")
    if isinstance(value, (dict, list)) and not several:
        raise ConfigError(f"{option.where}: {option.key}: expected one value (as {_flag(param)} takes). "
                          f"Received: {value!r}")
    type_name = str(getattr(param.type, "name", ""))
    try:
        for item in value if several and isinstance(value, list) else [value]:
            if isinstance(item, bool) and type_name != "boolean" or isinstance(item, float) and type_name in _WHOLE:
                raise ValueError(item)  # click would take true as 1 and 1.5 as 1
        value = param.type_cast_value(ctx, value)
    except Exception:  # click's BadParameter (whichever copy of click typer uses), or the check above
        kind = _KINDS.get(type_name, f"a {type_name or 'value'}")
        raise ConfigError(f"{option.where}: {option.key}: expected {kind}, as {_flag(param)} takes. "
                          f"Received: {option.value!r}") from None
    if value is None:
        return None
    is_path = "Path" in str(hint)
    if several:
        return [Path(item) if is_path else item for item in value]
    return Path(value) if is_path else value


def _at_its_line(exc: UsageError, ctx: typer.Context, came_from: dict[str, JobOption]) -> UsageError:
    """A command's error about ``--flag`` whose value came from a file: said at that file's line."""
    for name, option in came_from.items():
        param = next((p for p in ctx.command.params if p.name == name), None)
        if param is not None and any(exc.message == flag or exc.message.startswith((f"{flag}:", f"{flag} "))
                                     for flag in param.opts):
            return type(exc)(f"{option.where}: {option.key}: {exc.message}", detail=exc.detail)
    return exc


def _source(ctx: typer.Context, name: str) -> str:
    source = ctx.get_parameter_source(name)
    return source.name if source is not None else "DEFAULT"


def _flag(param: Any) -> str:
    if getattr(param, "param_type_name", "") == "argument":
        return "-- ARGS"  # the recipe's own arguments
    return max(param.opts, key=len) if getattr(param, "opts", None) else str(param.name)


def render_job(params: dict[str, Any]) -> str:
    """The job as a job file: every section, every key, its value now (``--print-config``)."""
    lines = ["# distrun train RECIPE --config THIS_FILE runs this job; null: distrun's default (docs/cli.md)"]
    for section in SECTIONS:
        body = {key: _plain(params.get(param)) for key, param in section.keys.items()}
        lines.append(yaml.safe_dump({section.name: body}, sort_keys=False, default_flow_style=False).rstrip())
    return "\n".join(lines) + "\n"


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value

