"""The runtime's Reporter: turns strategy progress into throttled events.

Step events are throttled to one per ``interval_s`` per replica (the first and
last step always go out), and ``loss.item()`` is only called for the steps
that are sent, so reporting never adds a device sync per step on GPU.

Each Step event also carries the rank's mean step time and compute time over the steps
since the previous one: a step's wall time runs from the end of the step before to the end
of this one (data loading included), and its compute time is that less what the strategy
measured as waiting for peers (``sync_wait_s``; on a GPU, the waits the GPU has finished by
then, so a window's sum lags its steps by a step or two). The client compares ranks' compute
times to name slow ones (``client/_stragglers.py``).

Evaluation is not a step: time spent inside ``outside_steps()`` is left out of the rates (the
events' and the summary's) and out of the step times.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import psutil

from distrun.protocol import (
    AllReduceChosen,
    Checkpointed,
    Compiled,
    Log,
    MembershipChanged,
    Synced,
    Resumed,
    Step,
    Workload,
)
from distrun.runtime._process import EventWriter


class EventReporter:
    def __init__(self, writer: EventWriter, rank: int, world_size: int, interval_s: float, device_type: str) -> None:
        self._writer = writer
        self._rank = rank
        self._world = world_size
        self._interval_s = interval_s
        self._gpu: Any = None  # a GpuProbe, opened at the first step event on a CUDA rank
        self._cuda = device_type == "cuda"
        self._proc = psutil.Process(os.getpid())
        self._net_sent_at_start = host_bytes_sent()
        self.total_steps: int | None = None
        self.current_step = 0
        #: What the rank does outside a step, for a failure there ("building the model"); None in the loop.
        self.during: str | None = None
        self.last_loss: Any = None
        self.first_step_time: float | None = None
        self._first_step_mono: float | None = None
        self._last_step_mono: float | None = None
        self._samples_after_first = 0
        # Time outside the steps (evaluation) is left out of every rate, as Lightning and Keras leave it
        # out of theirs: pending until the next step ends, then charged to the summary's span (a final
        # evaluation after the last step is never charged); the window's start moves past it at once.
        self._outside_pending_s = 0.0
        self._outside_in_span_s = 0.0
        self._outside_depth = 0
        self._window_start = time.monotonic()
        self._window_samples = 0
        self._last_emit = 0.0
        self._last_epoch = 0
        self._pushes: int | None = None
        self._staleness: int | None = None
        self._bytes_per_step: tuple[float, float] | None = None  # --embeddings ps: (embeddings, dense gradients)
        self._timed_steps = 0  # steps in the current window with a known wall time...
        self._step_s = 0.0  # ...their wall time...
        self._wait_s = 0.0  # ...and the part of it spent waiting for peers
        self._wait_known = True  # ...when every step of the window said (else no compute time is sent)
        self.profile: Any = None  # --profile: a ProfileWindow told of each step
        self._learning_rate: Any = None

    @property
    def learning_rate(self) -> Any:
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, source: Any) -> None:
        """A callable giving the lr of the newest step (None where unknown): each Step event carries
        it, and ``--tensorboard``'s and the trackers' taps read it."""
        self._learning_rate = source
        if hasattr(self._writer, "learning_rate"):
            self._writer.learning_rate = source

    # Reporter protocol -------------------------------------------------------

    def step_started(self, step: int) -> None:
        """Step ``step`` is about to run (strategies say so; a plain script's steps only end)."""
        if self.profile is not None:
            self.profile.before_step(step)

    def step(self, step: int, epoch: int, loss: Any, samples: int, sync_wait_s: float | None = None) -> None:
        """Step ``step`` ended; ``sync_wait_s``: how long of it this rank waited for its peers."""
        now = time.monotonic()
        outside, self._outside_pending_s = self._outside_pending_s, 0.0
        if self._last_step_mono is not None and now - outside > self._last_step_mono:
            wall = now - outside - self._last_step_mono
            self._timed_steps += 1
            self._step_s += wall
            if sync_wait_s is None:  # the strategy cannot tell its wait from its compute
                self._wait_known = False
            else:
                self._wait_s += max(sync_wait_s, 0.0)  # a GPU's waits arrive a step or two late: bounded per window
        self.current_step = step
        self.last_loss = loss
        self._last_epoch = epoch
        if self._first_step_mono is None:
            self._first_step_mono = now
            self.first_step_time = time.time()
        else:
            self._samples_after_first += samples
            self._outside_in_span_s += outside
        self._last_step_mono = now
        self._window_samples += samples
        last = self.total_steps is not None and step >= self.total_steps
        if step == 1 or last or now - self._last_emit >= self._interval_s:
            self._emit_step(now)
        if self.profile is not None:
            self.profile.after_step(step)

    @contextlib.contextmanager
    def outside_steps(self) -> Iterator[None]:
        """Time that is not training (an evaluation): left out of samples/s and of the next step's time.

        A rank's first evaluation imports torchmetrics (with scipy and matplotlib: 2.5-3 s on a 2-core
        host); counted, it read an 88-step run of a small model at twice the step time of the same
        layout over 201 steps (0.043 against 0.021 s), and ``--strategy auto``'s measured step with
        it. Only the fit loop marks its evaluations (a custom loop's or a script's are theirs to time).
        Streaming diloco's exchange in flight goes on meanwhile, so the step after an evaluation may
        wait for it a little less. A block inside another counts once, in the outer one."""
        outermost = self._outside_depth == 0
        self._outside_depth += 1
        if outermost and self._cuda:  # the last step's queued kernels are the step's, not the evaluation's
            import torch

            torch.cuda.synchronize()
        start = time.monotonic()
        try:
            yield
        finally:
            self._outside_depth -= 1
            if outermost:
                spent = time.monotonic() - start
                self._outside_pending_s += spent
                self._window_start += spent  # the window's rate: its span starts that much later

    def worker_progress(self, pushes: int, staleness: int) -> None:
        """parameter-server workers: own pushes and the last push's staleness (sent with the next Step)."""
        self._pushes, self._staleness = pushes, staleness

    def bytes_moved(self, embedding_bytes_per_step: float, dense_grad_bytes_per_step: float) -> None:
        """``--embeddings ps``: this replica's mean bytes a step so far (sent with the next Step)."""
        self._bytes_per_step = (embedding_bytes_per_step, dense_grad_bytes_per_step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._writer.emit(Log(rank=self._rank, time=time.time(), step=step, scalars=scalars))

    def workload(self, tokens_per_sample: int, flops_per_token: float | None, peak_flops: float | None,
                 devices: int) -> None:
        """The recipe's tokens per sample (and FLOPs per token): the client derives tokens/s and MFU."""
        self._writer.emit(Workload(rank=self._rank, time=time.time(), tokens_per_sample=tokens_per_sample,
                                   flops_per_token=flops_per_token, peak_flops=peak_flops, devices=devices))

    def checkpoint(self, step: int, path: str, blocked_ms: float) -> None:
        """A checkpoint is complete; ``blocked_ms``: how long the step that wrote it waited."""
        self._writer.emit(Checkpointed(rank=self._rank, time=time.time(), step=step, path=path,
                                       blocked_ms=round(blocked_ms, 3)))

    def resumed(self, step: int, path: str, *, past_end: bool) -> None:
        """``--resume``: the checkpoint training goes on from (the chief's, once)."""
        self._writer.emit(Resumed(rank=self._rank, time=time.time(), step=step, path=path, past_end=past_end))

    def compiled(self, stats: Any) -> None:
        """``--compile``: the compiler's figures changed (a CompileStats)."""
        self._writer.emit(Compiled(rank=self._rank, time=time.time(), graphs=stats.graphs,
                                   graph_breaks=stats.graph_breaks, recompiles=stats.recompiles,
                                   compile_s=stats.compile_s, reasons=stats.reasons))

    def allreduce_chosen(self, choice: Any) -> None:
        """``--allreduce auto``: the chief's choice (an AllReduceChoice), once."""
        self._writer.emit(AllReduceChosen(rank=self._rank, time=time.time(), algorithm=choice.algorithm,
                                          reason=choice.reason, flat_ms=choice.flat_ms,
                                          hierarchical_ms=choice.hierarchical_ms))

    def membership(self, change: Any, *, report: bool) -> None:
        """``--elastic``: a new group (a MembershipChange); the new chief reports it."""
        self._world = change.world_size
        if report:
            self._writer.emit(MembershipChanged(
                rank=self._rank, time=time.time(), generation=change.generation, step=change.step,
                world_size=change.world_size, left=list(change.left), joined=list(change.joined),
                recovery_s=change.recovery_s, steps_lost=change.steps_lost))

    def synced(self, *, step: int, outer_step: int, fragment: int, fragments: int, bytes_sent: int, elements: int,
               seconds: float, blocked_s: float, dtype: str) -> None:
        """``--strategy diloco``: a sync landed (the chief's)."""
        self._writer.emit(Synced(rank=self._rank, time=time.time(), step=step, outer_step=outer_step,
                                 fragment=fragment, fragments=fragments, bytes_sent=bytes_sent, elements=elements,
                                 seconds=round(seconds, 6), blocked_s=round(blocked_s, 6), dtype=dtype))

    # figures ----------------------------------------------------------------

    def flush(self) -> None:
        """Send the newest step if the throttle held it back; write a profile still open."""
        if self.current_step and self._last_emit < (self._last_step_mono or 0):
            self._emit_step(time.monotonic())
        if self.profile is not None:
            self.profile.close()

    @property
    def samples_per_s(self) -> float:
        """Job-wide samples/s from this replica's view, excluding the first (warm-up) step and the time
        spent outside the steps (evaluations) between it and the last."""
        if self._first_step_mono is None or self._last_step_mono is None:
            return 0.0
        span = self._last_step_mono - self._first_step_mono - self._outside_in_span_s
        return self._samples_after_first * self._world / span if span > 0 else 0.0

    def _emit_step(self, now: float) -> None:
        span = now - self._window_start
        rate = self._window_samples / span if span > 0 else 0.0
        self._window_start, self._window_samples, self._last_emit = now, 0, now
        steps, step_s, wait_s, known = self._timed_steps, self._step_s, self._wait_s, self._wait_known
        self._timed_steps, self._step_s, self._wait_s, self._wait_known = 0, 0.0, 0.0, True
        gpu_util, mem_mb = self._device_figures()
        peak = self.peak_mem_mb()
        self._writer.emit(
            Step(
                rank=self._rank,
                time=time.time(),
                step=self.current_step,
                epoch=self._last_epoch,
                loss=to_float(self.last_loss),
                samples_per_s=rate,
                mem_mb=mem_mb,
                gpu_util=gpu_util,
                total_steps=self.total_steps,
                pushes=self._pushes,
                staleness=self._staleness,
                peak_mem_mb=peak,
                step_ms=round(step_s / steps * 1e3, 3) if steps else None,
                compute_ms=round(max(step_s - wait_s, 0.0) / steps * 1e3, 3) if steps and known else None,
                lr=self._current_lr(),
                embedding_bytes_per_step=self._bytes_per_step[0] if self._bytes_per_step else None,
                dense_grad_bytes_per_step=self._bytes_per_step[1] if self._bytes_per_step else None,
            )
        )

    def _current_lr(self) -> float | None:
        """The newest step's lr, or None: a lookup that fails (a custom optimizer) never stops a step."""
        if self._learning_rate is None:
            return None
        try:
            return to_float(self._learning_rate())
        except Exception:  # noqa: BLE001 - the lr is a figure to show, not the run
            return None

    def net_bytes_sent(self) -> int | None:
        """Bytes this host sent on its network interfaces (not loopback) since this rank started."""
        now = host_bytes_sent()
        return now - self._net_sent_at_start if now is not None and self._net_sent_at_start is not None else None

    def peak_mem_mb(self) -> float | None:
        """This rank's peak memory: CUDA's max allocated on a GPU rank, else the process's peak
        resident set (VmHWM: for a rank forked warm, counted from its fork)."""
        if self._cuda:
            import torch

            return torch.cuda.max_memory_allocated() / 2**20
        return peak_rss_mb()

    def _device_figures(self) -> tuple[float | None, float]:
        """(GPU utilisation % or None, memory MB): NVML on a GPU rank, else the process's RSS."""
        if not self._cuda:
            return None, self._proc.memory_info().rss / 2**20
        if self._gpu is None:
            import torch

            from distrun.runtime._gpu import GpuProbe

            self._gpu = GpuProbe(torch.cuda.current_device())
        return self._gpu.sample()


def peak_rss_mb() -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def to_float(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None


def host_bytes_sent() -> int | None:
    """The kernel's count of bytes sent on every interface but loopback (None where unreadable)."""
    try:
        counters = psutil.net_io_counters(pernic=True)
    except (OSError, RuntimeError):
        return None
    return sum(c.bytes_sent for name, c in counters.items() if name != "lo")
