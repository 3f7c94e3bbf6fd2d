"""The typer application, and the one place where errors become exit codes."""

from __future__ import annotations

import atexit
import difflib
import os
import signal
import sys
import threading
from typing import NoReturn

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


#: click's ClickException, as typer raises it: its vendored copy (a typer.TyperException) in recent
#: releases, the click package's in older ones; found through typer's public BadParameter either way.
ClickErrors: type[Exception] = next(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "ClickException")


def usage_line(exc: Exception) -> str:
    """A typer usage error (a misspelt flag, a missing argument) as one line: the command,
    what is wrong, the closest flags first, where the help is."""
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "distrun"
    option = getattr(exc, "option_name", None)
    possibilities = list(getattr(exc, "possibilities", None) or ())
    if option and possibilities is not None and type(exc).__name__ == "NoSuchOption":
        # click lists them alphabetically; the nearest first reads better (--epoch: --epochs).
        def score(name: str) -> tuple[bool, float]:
            return name.startswith(option), difflib.SequenceMatcher(None, option, name).ratio()

        ranked = sorted(possibilities, key=score, reverse=True)
        near = [name for name in ranked if score(name)[0] == score(ranked[0])[0]
                and score(name)[1] >= score(ranked[0])[1] - 0.1][:2] if ranked else []
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        what = f"no such option {option}{hint}"
    else:
        what = " ".join(exc.format_message().split()).rstrip(".")
        what = what[:1].lower() + what[1:]
    return f"{command}: {what} (`{command} --help`)"


def _take_sigint() -> None:
    """Ctrl-C's handler even where SIGINT arrives ignored (a job started in the background from a
    script: ``setsid distrun train ... &``), so ``kill -INT`` stops the job as Ctrl-C does."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app and map distrun's errors to exit codes.

    typer runs outside its standalone mode so that its usage errors (exit 2) come out
    as one line (``usage_line``) rather than a box; ``--help``, ``--version`` and
    ``typer.Exit`` come back as exit codes. distrun never imports click itself: recent
    typer releases vendor their own copy (``ClickErrors`` finds its errors either way).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = _wants_debug(args)
    _take_sigint()
    try:
        code = app(args=args, prog_name="distrun", standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except ClickErrors as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `distrun` alone: the help, as typer prints it
            typer.echo(exc.format_message(), err=True)
        else:
            stderr.print(f"error: {usage_line(exc)}", markup=False)
        sys.exit(getattr(exc, "exit_code", 2))
    except typer.Abort:
        stderr.print("error: aborted", markup=False)
        sys.exit(1)
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


def run() -> NoReturn:
    """The console script and ``python -m distrun``: ``main``, then leave without tearing the
    interpreter down. What Python's own exit would do that matters is done first (other
    non-daemon threads joined, exit handlers run, the streams flushed); only the teardown of
    every module and object is skipped: 60-100 ms of a 1-step job on a warm cluster, which
    takes 0.9 s in all (docs/performance.md). ``--debug``'s traceback still leaves the usual way."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    # What Py_Finalize does first: join non-daemon threads (and wake idle executor workers,
    # threading's own exit hooks), then the atexit handlers.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # pragma: no cover - every CPython has it; joined by hand otherwise
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 - what Py_Finalize runs; os._exit would skip it
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # distrun ... | head: the reader left, nothing left to say
            pass
        except (OSError, ValueError):  # output lost (a full disk): fail as CPython's own exit does
            code = code or 120
    os._exit(code)
