"""The typer application, and the one place where errors become exit codes."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from distrun._version import __version__
from distrun.errors import DistrunError

app = typer.Typer(
    name="distrun",
    help="TensorFlow-style distribution strategies and a cluster runner for PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"distrun {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """distrun: ship a recipe from this machine, train it under any strategy."""


def _wants_debug(argv: list[str]) -> bool:
    head = argv[: argv.index("--")] if "--" in argv else argv
    return "--debug" in head


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app and map distrun's errors to exit codes.

    typer runs in its standalone mode and owns its own outcomes (usage errors:
    exit 2, ``--help``, ``--version``). distrun never imports click itself:
    recent typer releases vendor their own copy, whose exceptions the click
    package would not catch.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = _wants_debug(args)
    try:
        app(args=args, prog_name="distrun")
    except DistrunError as exc:
        if debug and exc.detail:
            stderr.print(exc.detail.rstrip(), markup=False)
        for line in getattr(exc, "stderr_tail", ()):
            stderr.print(f"  | {line}", markup=False, style="dim")
        stderr.print(f"error: {exc.message}", markup=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        stderr.print("error: interrupted", markup=False)
        sys.exit(130)
    except Exception:
        if debug:
            raise
        etype, value, _ = sys.exc_info()
        stderr.print(f"error: internal error: {etype.__name__ if etype else 'Exception'}: {value} "
                     "(run again with --debug for the traceback)", markup=False)
        sys.exit(1)
