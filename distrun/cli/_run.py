"""Rendering a running job to its end: the live table, ``--json``, a notebook's cell, or nothing.

``distrun train`` (and ``distrun attach``) hand the job to ``run_job``, which renders its events
until it ends and returns its summary. How it renders is the command's ``--json`` flag, unless
the Python API (``distrun.train``) chose otherwise with ``rendered_as``: a notebook gets a
table updated in place (an IPython display, not a widget, so the saved notebook keeps the
last view and the summary), and ``progress=False`` gets nothing at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live

from distrun.cli._app import stderr
from distrun.client import ClusterJob, LocalJob
from distrun.errors import DistrunError, Interrupted
from distrun.protocol import Diagnosed, Event, Heartbeat, JobSummary, Output, Resumed, event_to_dict
from distrun.ui import render_diagnosis, render_progress, render_summary

__all__ = ["JsonStream", "run_job", "rendered_as", "profile_line", "resumed_line", "print_json",
           "TERMINAL", "JSON", "NOTEBOOK", "QUIET"]

TERMINAL, JSON, NOTEBOOK, QUIET = "terminal", "json", "notebook", "quiet"
#: Set by the Python API for the length of one job; None: the command's own --json decides.
_MODE: ContextVar[str | None] = ContextVar("distrun_output_mode", default=None)
#: A notebook's table is redrawn at most this often (each redraw is a message to the front end).
_NOTEBOOK_REDRAW_S = 0.5


@contextlib.contextmanager
def rendered_as(mode: str) -> Iterator[None]:
    """Render the jobs run inside as ``mode`` (NOTEBOOK, QUIET, TERMINAL), whatever --json says;
    QUIET also silences the command's notes on stderr."""
    token = _MODE.set(mode)
    quiet_before = stderr.quiet
    stderr.quiet = mode == QUIET or quiet_before
    try:
        yield
    finally:
        stderr.quiet = quiet_before
        _MODE.reset(token)


def _mode(json_output: bool) -> str:
    return _MODE.get() or (JSON if json_output else TERMINAL)


@dataclasses.dataclass
class JsonStream:
    """``--json``: stdout's last line is the summary, on failure too (docs/live-view.md).

    ``run_job`` prints it once a job exists; a failure before that (a value the spec refuses,
    a host that cannot be reached) prints a failed one here, with the same error line.
    """

    enabled: bool
    started_s: float = dataclasses.field(default_factory=time.monotonic)
    summary_printed: bool = False

    def failed_before_the_job(self, exc: BaseException, *, recipe: Path, strategy: str | None,
                              replicas: int | None) -> None:
        if not self.enabled or self.summary_printed:
            return
        interrupted = isinstance(exc, (KeyboardInterrupt, Interrupted))
        message = exc.message if isinstance(exc, DistrunError) else "interrupted"
        print_json(JobSummary(status="interrupted" if interrupted else "failed", recipe=str(recipe),
                               strategy=strategy or "", replicas=replicas or 0, steps=0, final_loss=None,
                               samples_per_s=0.0, time_to_first_step_s=None,
                               wall_s=time.monotonic() - self.started_s, error=message).to_dict())
        self.summary_printed = True



def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_job(job: LocalJob | ClusterJob, *, json_output: bool,
            host_of_rank: Callable[[int], str] | None = None,
            after: Callable[[JobSummary], dict[str, Any]] | None = None,
            stream: JsonStream | None = None,
            decorate: Callable[[JobSummary], JobSummary] | None = None) -> JobSummary | None:
    """Render the job to its end and return its summary (a failure raises, after printing it);
    ``after(summary)`` runs before the summary is printed (results home); ``decorate(summary)``
    adds what only the command knows (``--strategy auto``'s plan)."""
    if stream is not None:
        stream.summary_printed = True  # from here on the summary is this function's to print
    mode = _mode(json_output)
    json_output = mode == JSON
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if main_thread else None
    status, error = "succeeded", None
    summary: JobSummary | None = None
    try:
        with job:
            _consume(job, mode, host_of_rank)
            try:
                summary = job.outcome().summary
            except Interrupted as exc:
                status, error = "interrupted", exc.message
                raise
            except KeyboardInterrupt:  # a second Ctrl-C while the job winds down: never "succeeded"
                status, error = "interrupted", "interrupted"
                raise
            except DistrunError as exc:
                status, error = "failed", exc.message
                raise
            finally:
                summary = summary or job.summary(status, error)
                if decorate is not None:
                    summary = decorate(summary)
                if after is not None:
                    _results_home(after, summary, json_output)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        if summary is not None:
            _print_summary(summary, mode)
            if mode != JSON and after is None:  # a fetched cluster job's line comes with its results
                _profile_note(job, summary, on_cluster=host_of_rank is not None)
    return summary


def _results_home(after: Callable[[JobSummary], dict[str, Any]], summary: JobSummary, json_output: bool) -> None:
    """Copy results home; a failure here is reported but never hides the job's own outcome."""
    try:
        results = after(summary)
    except DistrunError as exc:
        stderr.print(f"warning: results not copied home: {exc.message}", markup=False)
        return
    if json_output:
        print_json(results)
    else:
        where = results.get("checkpoint") or results["dir"]
        stderr.print(f"results: {where}", markup=False)
        if results.get("profile"):
            stderr.print(profile_line(len(results.get("profile_traces", ())), results["profile"]), markup=False)
        for missed in results.get("profile_missed", ()):
            stderr.print(f"warning: --profile traces not copied home from {missed}", markup=False)


def _profile_note(job: LocalJob | ClusterJob, summary: JobSummary, *, on_cluster: bool) -> None:
    """``--profile``: where the traces are, or that no step of the window ran."""
    window = job.spec.observe.profile_steps if job.spec is not None else None
    if summary.profile_traces and not on_cluster:
        stderr.print(profile_line(summary.profile_traces, str(summary.profile_dir)), markup=False)
    elif summary.profile_traces:  # attached, or --no-fetch: they are on the hosts
        stderr.print(f"profile: {summary.profile_traces} trace(s) on the hosts, in the job's folder; "
                     f"`distrun pull {getattr(job, 'job_id', 'JOB')} --cluster FILE` brings them home", markup=False)
    elif window and summary.status == "succeeded":
        stderr.print(f"profile: no step of --profile {window[0]}:{window[1]} ran (the job took {summary.steps} "
                     "step(s)); nothing was traced", markup=False)


def profile_line(traces: int, folder: str) -> str:
    """``--profile``: the one line that says where the traces are and what opens them."""
    return (f"profile: {traces} trace(s) in {folder} (open one in https://ui.perfetto.dev, or "
            f"`tensorboard --logdir {Path(folder).parent}` with torch-tb-profiler)")


def _consume(job: LocalJob | ClusterJob, mode: str, host_of_rank: Callable[[int], str] | None) -> None:
    """Render events until the job ends; Ctrl-C cancels the job and keeps draining."""
    if mode == JSON:
        # Heartbeats are liveness plumbing (they feed --hang-timeout-s), not part of the stream.
        _drain(job, lambda ev: print_json(event_to_dict(ev)) if ev is not None and not isinstance(ev, Heartbeat)
               else None)
        return
    if mode == QUIET:
        _drain(job, lambda _ev: None)
        return
    if mode == NOTEBOOK:
        view = _NotebookView(render_progress(job.snapshot()))
        _drain(job, lambda ev: view.show(_aside(ev, host_of_rank), render_progress(job.snapshot())))
        view.show(None, render_progress(job.snapshot()), final=True)
        return
    console = Console(stderr=not sys.stdout.isatty(), highlight=False)
    with Live(render_progress(job.snapshot()), console=console, refresh_per_second=4, transient=False) as live:
        def show(ev: Event | None) -> None:
            aside = _aside(ev, host_of_rank)
            if aside is not None:
                live.console.print(aside, markup=False, highlight=False, soft_wrap=True)
            live.update(render_progress(job.snapshot()))

        _drain(job, show)
    console.line()


def _aside(ev: Event | None, host_of_rank: Callable[[int], str] | None) -> RenderableType | None:
    """What an event prints above the live table: a rank's line, a diagnosis, a resume."""
    if isinstance(ev, Output):
        if ev.rank < 0:  # the evaluator, or a worker server's own note
            where = host_of_rank(ev.rank) if host_of_rank else "server"
        else:
            where = f"{host_of_rank(ev.rank)} rank {ev.rank}" if host_of_rank else f"rank {ev.rank}"
        return f"[{where}] {ev.line}"
    if isinstance(ev, Diagnosed):  # --hang-timeout-s: every rank's stack and last collective
        return render_diagnosis(ev)
    if isinstance(ev, Resumed):
        return resumed_line(ev)
    return None


class _NotebookView:
    """The live table in a notebook cell: one IPython display updated in place (``display_id``),
    which a saved notebook keeps as its last state; a rank's lines print as they come. rich's own
    Live would draw into an ipywidgets Output, whose content a saved notebook does not keep."""

    def __init__(self, first: RenderableType) -> None:
        from IPython.display import display  # a notebook has IPython; nothing else imports it

        self._last_s = 0.0
        self._handle = display(_plain(first), raw=True, display_id=True)

    def show(self, aside: RenderableType | None, table: RenderableType, *, final: bool = False) -> None:
        if aside is not None:
            print(_plain(aside)["text/plain"], flush=True)
        now = time.monotonic()
        if final or now - self._last_s >= _NOTEBOOK_REDRAW_S:
            self._last_s = now
            if self._handle is not None:
                self._handle.update(_plain(table), raw=True)


def _plain(renderable: RenderableType) -> dict[str, str]:
    """A rich renderable as a notebook's text/plain output (no colour codes, a fixed width)."""
    buffer = io.StringIO()
    Console(file=buffer, width=110, color_system=None, force_terminal=False, force_jupyter=False,
            highlight=False).print(renderable)
    return {"text/plain": buffer.getvalue().rstrip("\n")}


def resumed_line(event: Resumed) -> str:
    """``--resume``: the one line that says what was resumed (and that nothing is left to train)."""
    line = f"resumed from {event.path} at step {event.step}"
    if event.past_end:
        line += ": already at or past the job's last step (--steps, --epochs), so nothing is trained"
    return line


class _Interrupts:
    """Ctrl-C and SIGTERM while a job is drained, counted rather than raised.

    A KeyboardInterrupt is raised wherever the main thread stands when the handler runs, and one
    raised inside a finalizer (a ``__del__`` the garbage collector runs) Python prints as "Exception
    ignored" and drops. That is the likely end of a CI run's ``distrun attach``, which kept following
    30 s after its Ctrl-C with no detach begun. A count cannot be dropped: the drain loop reads it
    after every event, and the feed yields one at least every poll (0.25 s).

    A second signal before the first was acted on raises KeyboardInterrupt as before, so a main
    thread held elsewhere (a stdout nobody reads, a host slow to stop) can still be broken out of.
    Only a handler that would have raised is replaced: a SIGINT ignored, or a user's own handler
    (the Python API), stays as it was.
    """

    def __init__(self) -> None:
        self.taken = 0  # bumped by the handler alone: no lock, which a handler could deadlock on
        self.acted_on = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.taken += 1
        if self.taken - self.acted_on >= 2:
            raise KeyboardInterrupt

    def take(self) -> bool:
        """Whether a signal came since the last call (several count as one)."""
        if self.taken == self.acted_on:
            return False
        self.acted_on = self.taken
        return True

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # no handler runs there
            yield
            return
        raising = (signal.default_int_handler, _raise_interrupt)
        previous = {signum: handler for signum in (signal.SIGINT, signal.SIGTERM)
                    if (handler := signal.getsignal(signum)) in raising}
        for signum in previous:
            signal.signal(signum, self)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _drain(job: LocalJob | ClusterJob, handle: Any) -> None:
    """Hand every event to ``handle`` until the job ends; Ctrl-C (or SIGTERM) cancels the job, or
    detaches an attached client, and the draining goes on to the job's end. A signal that comes as
    the feed ends finds the job ended: its own outcome stands."""
    interrupts = _Interrupts()
    with interrupts.counted():
        while True:
            try:
                for event in job.events():  # a fresh generator after each KeyboardInterrupt
                    handle(event)
                    if interrupts.take():
                        job.cancel("interrupted", interrupted=True)
                return
            except KeyboardInterrupt:  # a second signal before the first was acted on, or the job's own
                interrupts.take()
                job.cancel("interrupted", interrupted=True)


def print_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _print_summary(summary: Any, mode: str) -> None:
    if mode == JSON:
        print_json(summary.to_dict())
    elif mode == NOTEBOOK:
        from IPython.display import display

        display(_plain(render_summary(summary)), raw=True)
    elif mode == TERMINAL:
        Console(stderr=not sys.stdout.isatty(), highlight=False).print(render_summary(summary))


