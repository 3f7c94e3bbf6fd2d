"""Timing spans of a replica's step where its device runs them: host clocks on a CPU, CUDA events on a GPU.

``sync_clock`` knows *where* a step waits for its peers; this module knows *how* to time a
span there. Both timers share one shape: ``mark()`` at a span's start, ``span(mark)`` at its
end, ``take_s()`` for the seconds of the spans finished since the last take.

On a CPU the wait happens on the calling thread, so a perf_counter read at each end is the
span, known at once (``HostTimer``).

On a GPU the CPU only enqueues work: DDP's and FSDP's waits for a collective are a
``wait_event`` on the compute stream, and the CPU passes them at once. The wait is where the
stream stalls, so the span's ends are CUDA events recorded on the current stream
(``CudaTimer``); their elapsed time is the stall, and it is known only once the GPU has passed
the end event. ``take_s`` reads the finished spans with ``query()`` (never a device sync), so a
step's wait is counted a step or two after it ran: over a reporting window of many steps the
sum is the same. Events are pooled; if more than ``max_pending`` spans are unread (the GPU far
behind, or nobody taking), the oldest is waited on and the finished ones are read into a
running sum, so the pending events stay bounded.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HostTimer", "CudaTimer", "timer_for"]


class HostTimer:
    """Spans timed with the host's clock: where the calling thread itself waits (gloo, CPU)."""

    def __init__(self) -> None:
        self._done_s = 0.0

    def mark(self, reuse: Any = None) -> float:
        return time.perf_counter()

    def span(self, start: float) -> None:
        self._done_s += time.perf_counter() - start

    def drop(self, mark: Any) -> None:
        """A mark that no span will close (nothing to give back on the host)."""

    def take_s(self) -> float:
        done, self._done_s = self._done_s, 0.0
        return done

    def discard(self) -> None:
        """Forget the spans not yet taken (a failed or a warm-up step's)."""
        self._done_s = 0.0


class CudaTimer:
    """Spans timed on the current CUDA stream with events, read once the GPU has passed them."""

    def __init__(self, new_event: Callable[[], Any] | None = None, max_pending: int = 4096) -> None:
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._max_pending = max_pending
        self._free: list[Any] = []
        self._pending: deque[tuple[Any, Any]] = deque()  # (start, end) in the order they were recorded
        self._may_capture = torch.cuda.is_available()  # a CPU-only torch has no graphs to capture
        self._done_s = 0.0  # spans read before a take (the GPU was waited on)

    def mark(self, reuse: Any = None) -> Any:
        """Record a span's start on the current stream; ``reuse``: a mark of this timer to move here
        (the last of many candidate starts, such as each accumulated backward's end, costs one event)."""
        if self._capturing():  # inside a CUDA graph's capture an event would be replayed with it: no span
            return reuse
        event = reuse if reuse is not None else self._event()
        event.record()
        return event

    def span(self, start: Any) -> None:
        if start is None or self._capturing():
            return
        end = self._event()
        end.record()
        self._pending.append((start, end))
        if len(self._pending) > self._max_pending:  # the GPU is far behind: wait for the oldest span
            self._pending[0][1].synchronize()
            self._done_s += self._read_finished()

    def drop(self, mark: Any) -> None:
        """A mark that no span will close: its event goes back to the pool."""
        self._free.append(mark)

    def take_s(self) -> float:
        """Seconds of the spans the GPU has finished since the last take."""
        done_s, self._done_s = self._done_s + self._read_finished(), 0.0
        return done_s

    def discard(self) -> None:
        """Forget the spans not yet taken, finished or not (a failed or a warm-up step's): their
        events go back to the pool (one still ahead of the GPU is simply recorded again later)."""
        while self._pending:
            self._free += self._pending.popleft()
        self._done_s = 0.0

    def _read_finished(self) -> float:
        """Seconds of the oldest spans the GPU has passed, removed from the pending ones."""
        done_s = 0.0
        while self._pending:
            start, end = self._pending[0]
            if not (end.query() and start.query()):
                break
            self._pending.popleft()
            done_s += start.elapsed_time(end) / 1e3  # milliseconds
            self._free += (start, end)
        return done_s

    @property
    def pending(self) -> int:
        """Spans recorded but not yet read."""
        return len(self._pending)

    def _capturing(self) -> bool:
        """Whether the current CUDA stream is capturing a graph (``--compile-mode reduce-overhead``)."""
        return self._may_capture and torch.cuda.is_current_stream_capturing()

    def _event(self) -> Any:
        return self._free.pop() if self._free else self._new_event()


def timer_for(device: torch.device) -> HostTimer | CudaTimer | None:
    """The timer for a replica on ``device``; None where distrun cannot time its stream (MPS, XPU)."""
    if device.type == "cpu":
        return HostTimer()
    if device.type == "cuda":
        return CudaTimer()
    return None
