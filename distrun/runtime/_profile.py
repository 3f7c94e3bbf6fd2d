"""``--profile START:END``: torch.profiler on this rank over a window of global steps.

A window, not the whole run: a trace of every op of every step grows by megabytes per step,
and the steps worth reading are the steady ones after warm-up (torchtitan profiles a few
steps the same way). Every rank profiles the same global steps, so the traces line up.

What is recorded: CPU activities, and CUDA's on a GPU rank; each op's input shapes
(``record_shapes``) and the memory it allocated (``profile_memory``). Each step is one
``ProfilerStep#<global step>`` range. The trace is torch's Chrome-trace JSON, named as
``torch.profiler.tensorboard_trace_handler`` names it (``rank<R>.<ms>.pt.trace.json``), so
Perfetto (ui.perfetto.dev) opens it and TensorBoard's profiler plugin finds it in its folder.

The strategy tells when a step begins (``before_step``) and ends (``after_step``); a plain
script has no "begins", so a window that starts at step 1 opens when the script starts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from distrun.protocol import Output, Profiled

__all__ = ["ProfileWindow"]


class ProfileWindow:
    """Opens torch.profiler before step ``start`` and writes the trace after step ``end``.

    A profiler that fails (a folder it cannot write, a script that runs its own profiler,
    CUPTI refusing) costs the job one line, never the job: the window is dropped.
    """

    def __init__(self, window: tuple[int, int], folder: str, rank: int, device_type: str, writer: Any) -> None:
        self.start, self.end = window
        self._folder = Path(folder)
        self._rank = rank
        self._cuda = device_type == "cuda"
        self._writer = writer
        self._profiler: Any = None
        self._first = 0
        self._last_step = 0
        self._before_start = False  # this process ran a step before START (so a jump past END is a jump)
        self._finished = False

    def before_step(self, step: int) -> None:
        """Step ``step`` is about to run (fit and custom-loop recipes)."""
        if self._profiler is None and not self._finished:
            self._maybe_open(step)

    def after_step(self, step: int) -> None:
        """Step ``step`` has run: the next step's range begins, or the window closes."""
        self._last_step = step
        if self._profiler is None:
            if not self._finished:  # a plain script has no before_step: the next step may open it
                if step < self.start:
                    self._before_start = True
                self._maybe_open(step + 1)
            return
        if step >= self.end:
            self._write()
            return
        try:
            self._profiler.step_num = step  # the next range is ProfilerStep#<step + 1>, after an elastic redo too
            self._profiler.step()
        except Exception as exc:  # noqa: BLE001 - a profiler failure must not fail training
            self._drop(f"profiling stopped at step {step}: {exc}")

    def open_now(self) -> None:
        """A window from step 1 in a script distrun does not step: open before the script runs."""
        if self.start == 1 and self._profiler is None and not self._finished:
            self._open(1)

    def close(self) -> None:
        """The job ends (or fails): a window still open is written with the steps it saw."""
        if self._profiler is not None:
            self._write()

    def _maybe_open(self, step: int) -> None:
        if step < self.start:
            self._before_start = True
        elif step <= self.end or self._before_start:  # past END: a parameter-server worker's steps jump
            self._open(step)
        else:  # resumed, restarted or rejoined past the window: it was profiled before, or never can be
            self._finished = True
            if self._rank == 0:
                self._note(f"--profile {self.start}:{self.end}: this run starts at step {step}, past the window; "
                           "nothing profiled")

    def _open(self, step: int) -> None:
        try:
            import torch
            from torch.profiler import ProfilerAction, ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda and torch.cuda.is_available()
                                                   else [])
            self._folder.mkdir(parents=True, exist_ok=True)
            # A schedule that always records: with one, torch marks each step's range (ProfilerStep#N).
            profiler = profile(activities=activities, schedule=lambda _step: ProfilerAction.RECORD,
                               record_shapes=True, profile_memory=True, with_stack=False)
            profiler.step_num = step  # the ranges carry global step numbers: ProfilerStep#<step>
            profiler.start()
        except Exception as exc:  # noqa: BLE001 - a profiler failure must not fail training
            self._drop(f"not started at step {step}: {exc}")
            return
        self._profiler, self._first = profiler, step

    def _write(self) -> None:
        profiler, self._profiler, self._finished = self._profiler, None, True
        path = self._folder / f"rank{self._rank}.{int(time.time() * 1000)}.pt.trace.json"
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            profiler.stop()
            profiler.export_chrome_trace(str(tmp))
            os.replace(tmp, path)
        except Exception as exc:  # noqa: BLE001 - a profiler failure must not fail training
            self._note(f"--profile: trace not written to {path}: {exc}")
            return
        last = max(self._first, min(self._last_step, self.end))
        self._writer.emit(Profiled(rank=self._rank, time=time.time(), start_step=self._first, end_step=last,
                                   path=str(path)))

    def _drop(self, why: str) -> None:
        profiler, self._profiler, self._finished = self._profiler, None, True
        if profiler is not None:
            try:
                profiler.stop()
            except Exception:  # noqa: BLE001 - already failing; the note says why
                pass
        self._note(f"--profile: {why}")

    def _note(self, line: str) -> None:
        self._writer.emit(Output(rank=self._rank, time=time.time(), stream="stderr", line=f"[distrun] {line}"))
