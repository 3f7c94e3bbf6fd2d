"""The probe: the recipe's own model and optimizer measured on one device of the real hardware.

What it measures, and how, so the cost model's inputs are figures and not guesses:

- parameter and gradient bytes, from the model; optimizer-state bytes after one real step of the
  recipe's optimizer (Adam's moments exist only then), over the whole model where its state fits
  beside it, else over the largest unit and scaled (the probe holds no more than a layout would);
- a sample's forward-and-backward time: a few runs at two batch sizes, each small one followed by a
  large one, with the threads one rank gets, as slope (per sample) and intercept (per forward) of
  the pair whose slope is the median; the optimizer's step apart (once a step, on whatever share
  of the state a rank holds);
- the activation bytes a sample keeps for backward: every tensor autograd saves, counted once per
  storage, through ``saved_tensors_hooks``; under full checkpointing a unit keeps only its input,
  so the bytes saved inside the units are replaced by the units' inputs;
- the largest crossing between two ``pp_chain`` parts (a pipeline sends it each microbatch);
- what ``--tp`` would split (the recipe's ``tp_plan``, or the plan distrun derives): the degrees it
  can take, the parameter bytes of the split layers, and the activation bytes a sample's forward and
  backward all-reduce among the tensor-parallel ranks (a row-wise layer's output in forward, a
  column-wise layer's input gradient in backward), counted by hooks on one forward;
- on a GPU, for ``--offload cpu``: the optimizer's step on the host's CPU (over a CPU copy of the
  largest unit, scaled by bytes);
- the process's own footprint before the model (the interpreter, torch), from ``/proc``.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil
import torch
from torch import nn

from distrun.planner.cost import ModelProfile
from distrun.planner.overheads import sharded_step_s
from distrun.strategies.sharding.units import pick_units

__all__ = ["line_through", "measure", "resident_bytes", "sharded_step"]

_REPEATS = 3
#: Rows of the first step and of the activation count; the share of the memory cap the timed
#: batches' activations may take.
_FIRST_ROWS = 2
_TIMED_SHARE = 0.25


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    return int(psutil.Process().memory_info().rss)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(item) for item in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    return 0


class _SavedBytes:
    """Bytes autograd saves for backward during a forward, split into inside and outside the units,
    plus the bytes of the units' inputs (what full checkpointing keeps instead)."""

    def __init__(self, units: Iterable[nn.Module], parameters: Iterable[torch.Tensor]) -> None:
        self.inside = self.outside = self.unit_inputs = 0
        self._depth = 0
        # A parameter's storage is saved too (a Linear's weight, as a transposed view): it is the
        # model's, kept whatever the batch, not an activation.
        self._seen: set[int] = {param.untyped_storage().data_ptr() for param in parameters}
        self._handles = []
        for unit in units:
            self._handles.append(unit.register_forward_pre_hook(self._enter))
            self._handles.append(unit.register_forward_hook(self._leave))

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0:
            self.unit_inputs += _tensor_bytes(args)
        self._depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen:
            self._seen.add(key)
            if self._depth:
                self.inside += storage.nbytes()
            else:
                self.outside += storage.nbytes()
        return tensor

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _give_back_memory() -> None:
    """Return freed heap pages to the system (glibc keeps them otherwise), so that what the probe
    freed no longer counts against a memory cgroup while it goes on."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the pages stay with the process, as before
        pass


def _timed(step: Callable[[], None], device: torch.device, together: Callable[[], None],
           slowest: Callable[[float], float] = lambda seconds: seconds) -> float:
    """The median of a few timed runs of ``step``, after one that warms it up; ``together`` lines the
    probe's processes up before each, so that they compute at once, as the job's ranks will, and
    ``slowest`` takes each run at its slowest process's pace, as a synchronous step goes.

    Why the slowest: on this project's 2-core machine each of the probe's two processes read the
    34M-parameter MLP's 1-row forward and backward at 0.05-0.07 s or at 0.13-0.15 s, a mode that
    mostly held through a probe (docs/performance.md#strategy-auto), and the first process's
    reading put the fixed part a microbatch anywhere from 0.013 to 0.120 s between runs. The job's
    ranks train at once, so the high reading is the one a step pays; the slowest process's read
    0.076-0.140 s."""
    step()
    return statistics.median(_run_s(step, device, together, slowest) for _ in range(_REPEATS))


def _run_s(step: Callable[[], None], device: torch.device, together: Callable[[], None],
           slowest: Callable[[float], float]) -> float:
    """One timed run of ``step``, the processes lined up before it, read at the slowest one's pace."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    together()
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return slowest(time.perf_counter() - start)


def _timed_pairs(small: Callable[[], None], large: Callable[[], None], device: torch.device,
                 together: Callable[[], None], slowest: Callable[[float], float]) -> list[tuple[float, float]]:
    """``_REPEATS`` timed runs of ``small`` each followed at once by one of ``large`` (after one of
    each that warms them up), as (small s, large s) pairs: a pair is read in one mode of the machine.

    Why pairs: the slope and the fixed part are a difference of the two timings, and this project's
    2-core machine steps the same batch at one of two paces (``_timed``). Timed in two blocks, a
    small batch read at the fast pace and a large one at the slow pace put the 34M-parameter MLP's
    fixed part a microbatch at 0.0-0.026 s in every budget scenario of four runs, against
    0.047-0.118 s with memory to spare, and a pipeline of it 30-43% under its run
    (docs/performance.md#strategy-auto)."""
    small()
    large()
    pairs = []
    for _ in range(_REPEATS):
        small_s = _run_s(small, device, together, slowest)
        pairs.append((small_s, _run_s(large, device, together, slowest)))
    return pairs


def line_through(pairs: list[tuple[float, float]], small_rows: int, large_rows: int) -> tuple[float, float]:
    """(seconds a sample, seconds a forward's fixed part) of a forward and backward, from timed
    (small, large) pairs: the line of the pair whose slope is the median, so that both figures come
    from one pair read at one pace, and a pair read across a change of pace (its slope and fixed
    part pushed to opposite extremes) is outvoted. Neither is below zero."""
    span = max(1, large_rows - small_rows)
    lines = sorted((max(0.0, (large - small) / span), small) for small, large in pairs)
    slope, small_s = lines[(len(lines) - 1) // 2]
    return slope, max(0.0, small_s - slope * small_rows)


def _boundary_bytes(chain: list[nn.Module], inputs: Any) -> int:
    """The largest output of a ``pp_chain`` part that the next part takes (one forward, no grad)."""
    largest, x = 0, inputs
    with torch.no_grad():
        for part in chain[:-1]:
            x = part(*x) if isinstance(x, tuple) else part(x)
            largest = max(largest, _tensor_bytes(x))
    return largest


#: --tp degrees the probe tries (each must divide the ranks of a host, as a tensor-parallel group stays in one).
TP_DEGREES = (2, 4, 8)


def _tensor_parallel(model: nn.Module, plan_from: Callable[[nn.Module], Any] | None, up_to: int,
                     forward_once: Callable[[], None], rows: int) -> dict[str, Any]:
    """What ``--tp`` would split of ``model``: ``tp_degrees`` (those up to ``up_to`` its plan takes),
    ``tp_split_bytes``, ``tp_bytes_per_sample`` (all-reduced, forward and backward) and ``tp_messages``
    (all-reduces a forward and backward). Nothing where no plan splits it (a recipe's ``tp_plan`` that
    raises is refused where ``--tp`` is named, not here: auto only leaves --tp out)."""
    none: dict[str, Any] = {"tp_degrees": (), "tp_split_bytes": 0, "tp_bytes_per_sample": 0, "tp_messages": 0}
    if up_to < min(TP_DEGREES):
        return none
    from distrun.strategies.parallel.plan import resolve_plan  # DTensor's imports: only where --tp may run

    degrees, styles = [], None
    for tp in (t for t in TP_DEGREES if t <= up_to):
        try:
            plan = resolve_plan(model, plan_from, tp)
        except Exception:  # noqa: BLE001 - no plan, a layer this degree does not divide, a tp_plan that raises
            continue
        degrees.append(tp)
        styles = styles or plan.styles
    if not degrees or styles is None:
        return none
    kinds = {name: style if isinstance(style, str) else type(style).__name__ for name, style in styles.items()}
    split = [name for name, kind in kinds.items() if kind.lower().startswith(("colwise", "rowwise", "output"))]
    if not split:
        return none
    modules = dict(model.named_modules())
    moved = [0]

    def after_row(module: nn.Module, args: Any, output: Any) -> None:  # forward: its partial sums all-reduced
        moved[0] += _tensor_bytes(output)

    def before_col(module: nn.Module, args: Any) -> None:  # backward: its input's gradient all-reduced
        moved[0] += _tensor_bytes(args)

    handles, messages = [], 0
    for name in split:
        kind = kinds[name].lower()
        if kind.startswith(("rowwise", "output")):  # "output": its logits gathered in forward too
            handles.append(modules[name].register_forward_hook(after_row))
            messages += 1
        if kind.startswith(("colwise", "output")):
            handles.append(modules[name].register_forward_pre_hook(before_col))
            messages += 1
    try:
        forward_once()
    finally:
        for handle in handles:
            handle.remove()
    split_bytes = sum(p.numel() * p.element_size() for name in split for p in modules[name].parameters())
    return {"tp_degrees": tuple(degrees), "tp_split_bytes": split_bytes, "tp_bytes_per_sample": moved[0] // rows,
            "tp_messages": messages}


def _optimizer_cost(model: nn.Module, units: list[nn.Module], make_optimizer: Callable[[Any], Any],
                    parameter_bytes: int, forward_backward: Callable[[Any], None], batch: Any,
                    device: torch.device, together: Callable[[], None], agree: Callable[[bool], bool],
                    base_bytes: int, memory_cap_bytes: int | None,
                    slowest: Callable[[float], float]) -> tuple[int, float]:
    """The recipe's optimizer's state bytes (after its first step: Adam's moments exist only then) and
    its step's time, over the whole model.

    Where the whole model's state would crowd the budget the probe measures for (a layout that
    shards the state may fit where a copy of it does not), the optimizer is built on the largest
    unit's parameters alone and both figures are scaled by the bytes: an optimizer's state and its
    step go element by element. So a probe process never holds more than the parameters, their
    gradients and a batch's activations, less than any layout's rank but a sharded one's over many
    ranks (docs/strategies.md#auto).
    """
    # No units (a model of no repeated blocks) leave nothing smaller to measure on: the whole model.
    whole = not units or agree(memory_cap_bytes is None or base_bytes + 5 * parameter_bytes <= memory_cap_bytes // 2)
    params = list(model.parameters()) if whole else \
        list(max(units, key=lambda unit: sum(p.numel() * p.element_size() for p in unit.parameters())).parameters())
    part_bytes = sum(p.numel() * p.element_size() for p in params)
    optimizer = make_optimizer(params)
    forward_backward(batch)
    optimizer.step()  # the state exists after the first step
    state_bytes = sum(_tensor_bytes(state) for state in optimizer.state.values())
    forward_backward(batch)  # gradients for the timed steps
    step_s = _timed(optimizer.step, device, together, slowest)
    # Then without it: the timed batches' activations never meet the optimizer's state.
    model.zero_grad(set_to_none=True)
    optimizer.state.clear()
    for group in optimizer.param_groups:
        group["params"] = []
    del optimizer
    _give_back_memory()
    scale = parameter_bytes / part_bytes if part_bytes else 1.0
    return int(state_bytes * scale), step_s * scale


def _cpu_optimizer_s(model: nn.Module, units: list[nn.Module], make_optimizer: Callable[[Any], Any],
                     parameter_bytes: int) -> float:
    """``--offload cpu``'s optimizer step: the recipe's optimizer over a CPU copy of the largest unit's
    parameters (the whole model where it has none), timed after its first step, scaled by bytes."""
    source = max(units, key=lambda unit: sum(p.numel() for p in unit.parameters())) if units else model
    params = [nn.Parameter(p.detach().to("cpu", copy=True)) for p in source.parameters()]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer = make_optimizer(params)
    optimizer.step()  # the state exists after the first step
    step_s = _timed(optimizer.step, torch.device("cpu"), lambda: None)
    part_bytes = sum(p.numel() * p.element_size() for p in params)
    return step_s * parameter_bytes / part_bytes if part_bytes else step_s


def measure(*, model: nn.Module, make_optimizer: Callable[[Any], Any], loss_fn: Callable[[Any, Any], torch.Tensor],
            forward: Callable[[nn.Module, Any], Any], batch_of: Callable[[int], Any], rows: int,
            device: torch.device, base_bytes: int, units_from: Callable[[nn.Module], Any] | None = None,
            chain_from: Callable[[nn.Module], list[nn.Module]] | None = None,
            together: Callable[[], None] = lambda: None, agree: Callable[[bool], bool] = lambda flag: flag,
            slowest: Callable[[float], float] = lambda seconds: seconds,
            memory_cap_bytes: int | None = None,
            tp_plan_from: Callable[[nn.Module], Any] | None = None, tp_up_to: int = 1) -> ModelProfile:
    """Measure ``model`` (on ``device``) with batches of ``batch_of(k)`` samples, ``rows`` the largest
    a forward will see (the timings use ``rows``, or fewer where their activations would take more
    than a quarter of ``memory_cap_bytes``, and a quarter of that).

    ``together`` lines the probe's processes up; ``agree`` makes a choice all of them take (true only
    where it is true in each): a choice read from a process's own memory could differ between them,
    and one process sharding the model while another does not would wait forever; ``slowest`` is
    the largest of the processes' readings of one timed run (see ``_timed``). ``tp_plan_from``
    (the recipe's ``tp_plan``) and ``tp_up_to`` (the most ranks a tensor-parallel group may have):
    what ``--tp`` would split."""
    model = model.to(device)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    units = pick_units(model, units_from).modules
    largest_unit = max((sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in units),
                       default=parameter_bytes)

    def forward_backward(batch: Any) -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(forward(model, batch), batch).backward()

    first = min(rows, _FIRST_ROWS)
    batch_first = batch_of(first)
    optimizer_bytes, t_optimizer = _optimizer_cost(model, units, make_optimizer, parameter_bytes, forward_backward,
                                                   batch_first, device, together, agree, base_bytes,
                                                   memory_cap_bytes, slowest)

    saved = _SavedBytes(units, model.parameters())  # on a few rows: activations grow with the rows, and a full batch may not fit
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
            loss_fn(forward(model, batch_first), batch_first).backward()
    finally:
        saved.close()
    model.zero_grad(set_to_none=True)
    per_sample = (saved.inside + saved.outside) / first
    checkpointed = (saved.outside + saved.unit_inputs) / first
    # The timed batches: the replica's rows where their activations take at most a quarter of what
    # this process may use, else as many as do (the layouts that need more are the ones auto avoids).
    rows = max(first, min(rows, int(_TIMED_SHARE * memory_cap_bytes / max(1.0, per_sample)))) \
        if memory_cap_bytes else rows
    small = max(1, rows // 4)
    batch_small, batch_large = batch_of(small), batch_of(rows)

    def forward_only(batch: Any) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                forward(model, batch)
        return run

    pairs = _timed_pairs(lambda: forward_backward(batch_small), lambda: forward_backward(batch_large),
                         device, together, slowest)
    slope, intercept = line_through(pairs, small, rows)
    f_large = _timed(forward_only(batch_large), device, together, slowest)
    # The pipeline's chain as --pp takes it: the recipe's pp_chain, or an nn.Sequential's children.
    chain = list(chain_from(model)) if chain_from is not None else (
        list(model.children()) if isinstance(model, nn.Sequential) else [])
    boundary = _boundary_bytes(chain, _first(batch_large)) // rows if chain else 0
    tensor_parallel = _tensor_parallel(model, tp_plan_from, tp_up_to, forward_only(batch_small), small)
    optimizer_cpu_s = 0.0
    if device.type == "cuda":
        try:
            optimizer_cpu_s = _cpu_optimizer_s(model, units, make_optimizer, parameter_bytes)
        except Exception:  # noqa: BLE001 - an optimizer for GPUs only (fused, capturable, ...): no --offload
            optimizer_cpu_s = 0.0
    model.zero_grad(set_to_none=True)
    del batch_large
    _give_back_memory()
    return ModelProfile(
        parameter_bytes=parameter_bytes, gradient_bytes=gradient_bytes, optimizer_bytes=optimizer_bytes,
        units=len(units), largest_unit_bytes=largest_unit, compute_s_per_sample=slope,
        forward_s_per_sample=f_large / rows, activation_bytes_per_sample=int(per_sample),
        checkpointed_activation_bytes_per_sample=int(checkpointed), base_bytes=base_bytes,
        chain_parts=len(chain), boundary_bytes_per_sample=int(boundary), device=device.type, overhead_s=intercept,
        optimizer_s=t_optimizer, probe_rows=small, optimizer_cpu_s=optimizer_cpu_s,
        **tensor_parallel)


def sharded_step(model: nn.Module, profile: ModelProfile, *, make_optimizer: Callable[[Any], Any],
                 loss_fn: Callable[[Any, Any], torch.Tensor], forward: Callable[[nn.Module, Any], Any], batch: Any,
                 units_from: Callable[[nn.Module], Any] | None, agree: Callable[[bool], bool],
                 memory_cap_bytes: int | None) -> float:
    """A step of ``model`` (the one :func:`measure` profiled) sharded over the default group on
    ``batch`` (``profile.probe_rows`` samples), timed; 0 where a process's budget has no room for
    it (sharded's cost then comes from the collectives' rates, planner/cost.py). Every process calls
    it at once, after whatever else it times: it shards the model in place, and on CPU it fixes the
    process's allocator as sharded does (planner/overheads.py)."""
    if not agree(memory_cap_bytes is None or profile.base_bytes + 6 * profile.parameter_bytes < memory_cap_bytes):
        return 0.0

    def step(sharded: nn.Module, sharded_optimizer: Any) -> None:
        sharded_optimizer.zero_grad(set_to_none=True)
        loss_fn(forward(sharded, batch), batch).backward()
        sharded_optimizer.step()
    return sharded_step_s(model, tuple(pick_units(model, units_from).modules), make_optimizer, step)


def _first(batch: Any) -> Any:
    return batch[0] if isinstance(batch, (tuple, list)) else batch
