"""How long a replica's step waited for its peers: what separates its compute time from its step time.

Under a synchronous strategy every replica's step ends at the same moment (the gradients'
all-reduce, or FSDP's gathers, wait for the slowest), so step times cannot name a slow
replica; the time each one spent waiting can. A step's wait is measured where it happens:

- **Gradients** (DDP under mirrored and multi-worker): from the end of this replica's backward
  (a callback queued on autograd's engine at its first accumulated gradient,
  ``register_post_accumulate_grad_hook``, so it runs before DDP's own, queued at its last
  bucket) to the optimizer's step (``register_step_pre_hook``). In between, DDP waits for
  the buckets' all-reduce, which waits for the slowest replica. One mark per backward, not
  one per parameter: on a GPU each mark is an event.
- **Shards** (FSDP2 under sharded): the time inside each FSDP parameter group's
  ``unshard``, ``wait_for_unshard``, ``post_backward`` and ``finalize_backward``, and inside
  the root's end-of-backward callback, where FSDP all-gathers a block's parameters (in
  forward and again in backward) and reduce-scatters its gradients, each of which waits for
  the slowest rank. These are FSDP's own methods, timed on each instance (not patched on the
  class); a call made inside another timed one counts once. On a torch whose FSDP2 lacks them
  the clock ``measures`` nothing, and no compute time is claimed.

Only waits inside a step count (between ``begin()`` and ``waited_s()``): an evaluation's
gathers between steps are not a step's wait. The first step after ``watch`` is a warm-up
(communicators built, FSDP's state made; the reporter times no wall for it either) and a step
that raised ends with ``discard()``: their waits are not read into a later step's.

How a span is timed is ``span_timer``'s: host clocks on a CPU, CUDA events on the compute
stream on a GPU, where these waits only stall the stream and the CPU passes them at once. A
GPU's waits are read once the GPU has run them, so each step reports the waits finished since
the step before. Other accelerators are not timed: their clock ``measures`` nothing.

A strategy whose replicas meet where waiting and computing cannot be told apart
(central-storage's central optimizer) does not ask the clock (``Strategy._sync_wait_s``).

A straggler's wait is only the transfer itself; its peers' is that plus its lateness. One
clock read or event per backward or per FSDP call: no device sync, no collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

from distrun.strategies.step.span_timer import CudaTimer, HostTimer, timer_for

__all__ = ["SyncClock"]


class SyncClock:
    """Per step: ``begin()``, then the hooks add up the wait; ``waited_s()`` reads it and ends the step."""

    def __init__(self) -> None:
        self._timer: HostTimer | CudaTimer | None = None
        self._handles: list[Any] = []
        self._timed: list[tuple[Any, dict[str, Any]]] = []  # (FSDP instance, what its __dict__ held before)
        self._ready: Any = None  # the mark of this step's newest end of backward (DDP)
        self._backward_ending = False  # the end-of-backward callback is queued
        self._in_step = False
        self._warm = False  # a step has ended since watch()
        self._depth = 0  # timed FSDP calls open (one inside another counts once)

    @property
    def measures(self) -> bool:
        """Whether the waits are timed: hooks installed on a replica whose device has a timer."""
        return self._timer is not None and bool(self._handles or self._timed)

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
        """Hook ``model``'s parameters and sharded modules, and ``optimizer``'s step (again after a rebuild)."""
        self.close()
        self._timer = timer_for(device)
        if self._timer is None:
            return
        groups, states = _fsdp_parts(model)
        if groups:  # sharded: FSDP's collectives are the waits (its gradients arrive after them)
            if all(self._can_time(group, _FSDP_GROUP_WAITS) for group in groups):
                for group in groups:
                    self._time(group, _FSDP_GROUP_WAITS)
                for state in states:
                    if self._can_time(state, _FSDP_STATE_WAITS):
                        self._time(state, _FSDP_STATE_WAITS)
            return
        # Parameters that get a gradient here: not a hybrid's emptied tables (their rows' gradients go
        # to the ps tasks). With none (every table on the ps tasks), nothing is timed, and the wait is
        # said to be unmeasured rather than 0.
        trainable = [param for param in model.parameters() if param.requires_grad and param.numel()]
        if optimizer is not None and trainable:
            self._handles.append(optimizer.register_step_pre_hook(self._optimizer_steps))
            for param in trainable:
                self._handles.append(param.register_post_accumulate_grad_hook(self._gradient_ready))

    def begin(self) -> None:
        self._in_step = True
        self._release_ready()

    def waited_s(self) -> float:
        """The wait timed since the last call (on a GPU: the spans it has finished); ends the step."""
        if not self._warm:  # the warm-up step: its waits are not the job's
            self._warm = True
            self.discard()
            return 0.0
        self._in_step = False
        self._release_ready()
        return self._timer.take_s() if self._timer is not None else 0.0

    def discard(self) -> None:
        """End the step and forget its waits (it raised, or warmed up), so no later step counts them."""
        self._in_step = self._backward_ending = False  # a backward that raised never ran its callback
        self._release_ready()
        if self._timer is not None:
            self._timer.discard()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for part, before in self._timed:
            for name, held in before.items():  # what was there: the class's method, or another wrapper
                if held is _NOTHING:
                    part.__dict__.pop(name, None)
                else:
                    part.__dict__[name] = held
        self._timed.clear()
        self.discard()
        self._warm = False
        self._depth = 0

    def _release_ready(self) -> None:
        if self._ready is not None and self._timer is not None:
            self._timer.drop(self._ready)
        self._ready = None

    def _gradient_ready(self, _param: torch.Tensor) -> None:
        if self._in_step and not self._backward_ending:
            try:
                Variable._execution_engine.queue_callback(self._backward_ended)
                self._backward_ending = True
            except RuntimeError:  # no engine to queue on (a hook called outside backward): mark here
                self._backward_ended()

    def _backward_ended(self) -> None:
        self._backward_ending = False
        if self._in_step and self._timer is not None:  # the last of several backwards (accumulation) wins
            self._ready = self._timer.mark(reuse=self._ready)

    def _optimizer_steps(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._ready is not None and self._timer is not None:
            self._timer.span(self._ready)
            self._ready = None

    @staticmethod
    def _can_time(part: Any, names: tuple[str, ...]) -> bool:
        return all(callable(getattr(part, name, None)) for name in names)

    def _time(self, part: Any, names: tuple[str, ...]) -> None:
        before = {name: part.__dict__.get(name, _NOTHING) for name in names}
        for name in names:
            setattr(part, name, self._timed_call(getattr(part, name)))
        self._timed.append((part, before))

    def _timed_call(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            timer = self._timer
            if not self._in_step or self._depth or timer is None:
                return method(*args, **kwargs)
            self._depth += 1
            start = timer.mark()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                timer.span(start)

        return timed


_NOTHING = object()  # an instance's __dict__ held no such attribute

#: FSDP2's FSDPParamGroup methods that hold its collectives or wait for them (the gathers, the
#: reduce-scatter, and the end of backward, where the compute stream waits for the last one).
_FSDP_GROUP_WAITS = ("unshard", "wait_for_unshard", "post_backward", "finalize_backward")
#: FSDP2's FSDPState method queued at the end of backward: it waits for the reduce-scatters in flight.
_FSDP_STATE_WAITS = ("_root_post_backward_final_callback",)


def _fsdp_parts(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """Every FSDP2 parameter group and FSDP state in ``model`` (empty when it is not sharded)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return [], []
    groups: list[Any] = []
    states: list[Any] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if state not in states:
                states.append(state)
            found = getattr(state, "_fsdp_param_groups", None)
            if found is None:  # older FSDP2: one group per state
                found = [getattr(state, "_fsdp_param_group", None)]
            groups.extend(group for group in found if group is not None and group not in groups)
    return groups, states
