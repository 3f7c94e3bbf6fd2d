"""DiLoCoStrategy: replicas that train alone and meet every H steps (``--strategy diloco``).

For hosts joined by ordinary Ethernet, where every synchronous strategy spends most of a step
on the wire. Each replica takes ``sync_every`` (H) inner steps with the recipe's optimizer on
its share of the global batch, exchanging nothing. Then the replicas average their
pseudo-gradient (global weights minus their own), an outer SGD with Nesterov momentum applies
it to the global weights (host memory, fp32), and every replica goes on from them, its inner
optimizer state kept. One exchange of the model per H steps instead of one per step.

- ``sync_dtype``: what a pseudo-gradient crosses the wire as (local_sgd/wire.py).
- ``fragments`` K > 1 is streaming DiLoCo: the model's units are cut into K fragments
  (local_sgd/fragments.py), each syncing at its own step of the H. A fragment's exchange runs
  in a background thread on its own process group while the next step computes; when it
  lands, one step later, the fragment's global weights are mixed with the replica's (which
  took that step meanwhile) half and half: the paper's alpha of 0.5.
- With H=1, outer lr 1 and no outer momentum, the new global weights are the replicas' mean
  after one inner step: for SGD (with momentum too, each replica's buffer being the mean's
  share) exactly mirrored's step.

The global weights are what the job is: evaluation runs them, checkpoints hold them (with the
outer optimizer and every replica's inner state), and the run ends with a sync, so its last
weights are global ones. A checkpoint is written at a sync (``--checkpoint-every`` a multiple
of H; the last one and a preempted job's sync first).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distrun.strategies.base import Strategy
from distrun.strategies.elastic.heal import broadcast_tensors
from distrun.strategies.local_sgd.elastic import ElasticSyncs
from distrun.strategies.local_sgd.fragments import Fragments, split_fragments
from distrun.strategies.local_sgd.inner_state import gather_states
from distrun.strategies.local_sgd.outer import GlobalWeights
from distrun.strategies.local_sgd.wire import PseudoGradientWire, SyncCost
from distrun.strategies.sharding.units import pick_units

__all__ = ["DiLoCoStrategy", "MIX_ALPHA"]

#: Streaming DiLoCo: the share of a replica's own weights kept when an overlapped fragment's
#: global weights land (the paper's alpha).
MIX_ALPHA = 0.5


@dataclass
class _InFlight:
    """A fragment's exchange running in the background."""

    fragment: int
    launched_step: int
    started: float
    future: Future[tuple[list[torch.Tensor], SyncCost]]


class DiLoCoStrategy(ElasticSyncs, Strategy):
    name = "diloco"

    def __init__(self, *args: Any, sync_every: int = 100, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 sync_dtype: str = "fp32", fragments: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sync_every = sync_every
        self._outer_lr = outer_lr
        self._outer_momentum = outer_momentum
        self._sync_dtype = sync_dtype
        self._fragment_count = fragments
        self._params: list[nn.Parameter] = []
        self._global: GlobalWeights | None = None
        self._fragments: Fragments | None = None
        self._wire: PseudoGradientWire | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: _InFlight | None = None
        self._synced_at: dict[int, int] = {}  # fragment -> the step its global weights last landed
        self.last_sync_step = 0  # the step of the newest whole-model sync (its last fragment's)
        self.healed_into_owed_sync = False  # --elastic: healed from a peer that owes a sync (its own weights are global)
        self._blocked_s = 0.0  # this step's wait for syncs (its "wait for peers")

    # -- building -------------------------------------------------------------

    def _wrap(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        model = model.to(self.device)
        if self._elastic is None:  # a joiner's weights come from the heal, in a round the members run too
            # The same start everywhere, whatever each rank's RNG did: one broadcast per dtype.
            broadcast_tensors([*model.parameters(), *model.buffers()], 0, self._collective_device)
        self._params = list(model.parameters())
        self._global = GlobalWeights(self._params, lr=self._outer_lr, momentum=self._outer_momentum)
        units = pick_units(model, self.units_from).modules if self._fragment_count > 1 else ()
        self._fragments = split_fragments(model, units, self._fragment_count, self.sync_every)
        group = None
        if self._fragment_count > 1:  # a group of its own: the background exchange never meets the step's
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distrun-diloco-sync")
            group = dist.new_group(backend=dist.get_backend())
        self._wire = PseudoGradientWire(self._sync_dtype, members=self.num_replicas, rank=self.replica_id,
                                        group=group)
        if self.is_chief:
            spread = f", {len(self._fragments)} fragments" if len(self._fragments) > 1 else ""
            print(f"[diloco] {self.num_replicas} replicas sync every {self.sync_every} steps{spread}: "
                  f"{self._sync_dtype} pseudo-gradients, outer SGD lr {self._outer_lr:g} "
                  f"momentum {self._outer_momentum:g}{' (Nesterov)' if self._outer_momentum > 0 else ''}", flush=True)
        return model, optimizer

    # -- the step: sync when due ----------------------------------------------

    @property
    def outer_steps(self) -> int:
        return self._global.outer_steps if self._global is not None else 0

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A step, after the sync a change of membership interrupted (``--elastic``), if one is owed."""
        self._blocked_s = 0.0
        if self._elastic is not None and self.owes_sync():
            self._sync(0, owed=True)
        return super().run(fn, *args, **kwargs)

    def _after_step(self) -> None:
        if self._fragments is None:
            return
        if self._in_flight is not None and self.step > self._in_flight.launched_step:
            self._land()  # one step of overlap (the paper's tau = 1)
        for fragment in self._fragments.due(self.step):
            if len(self._fragments) == 1:
                self._sync(fragment)
            else:
                self._launch(fragment)

    def _sync_wait_s(self, timed_s: float | None) -> float | None:
        """A replica waits for its peers only at a sync: what this step spent there."""
        return (timed_s or 0.0) + self._blocked_s

    def _sync(self, fragment: int, *, keep_local: float = 0.0, owed: bool = False) -> None:
        """Exchange ``fragment``'s pseudo-gradient now, step its global weights, take them.

        ``owed``: the sync a change of membership interrupted, redone by the new group; a member
        healed into it (its weights the global ones) counts for nothing in the mean. Under
        ``--elastic`` every sync carries a weight, owed or not: members of one round may meet the
        same sync from either side (one that had trained to it and owes it, one put back to the
        last sync that trains to it again), and the wire must be the same size on both.
        """
        started = time.perf_counter()
        indices = self._fragments.indices[fragment]
        weight = None
        if self._elastic is not None:
            weight = 0.0 if owed and self.healed_into_owed_sync else 1.0
        mean, cost = self._wire.mean(fragment, self._on_wire(self._global.pseudo_gradient(indices, self._params)),
                                     weight=weight)
        self.healed_into_owed_sync = False
        self._apply(fragment, mean, keep_local=keep_local)
        seconds = time.perf_counter() - started
        self._blocked_s += seconds
        self._report_sync(fragment, cost, seconds, seconds)

    def _launch(self, fragment: int) -> None:
        if self._in_flight is not None:  # H/K of 1: the previous fragment lands first
            self._land()
        indices = self._fragments.indices[fragment]
        tensors = self._on_wire(self._global.pseudo_gradient(indices, self._params))
        future = self._executor.submit(self._wire.mean, fragment, tensors)
        self._in_flight = _InFlight(fragment, self.step, time.perf_counter(), future)

    def _land(self) -> None:
        flight, self._in_flight = self._in_flight, None
        waited = time.perf_counter()
        mean, cost = flight.future.result()
        blocked = time.perf_counter() - waited
        self._blocked_s += blocked
        self._apply(flight.fragment, mean, keep_local=MIX_ALPHA)
        self._report_sync(flight.fragment, cost, time.perf_counter() - flight.started, blocked)

    def _apply(self, fragment: int, mean: list[torch.Tensor], *, keep_local: float) -> None:
        indices = self._fragments.indices[fragment]
        self._global.step(indices, mean)
        self._global.copy_into(indices, self._params, keep_local=keep_local)
        self._synced_at[fragment] = self.step
        if fragment == len(self._fragments) - 1:
            self._global.outer_steps += 1
            self.last_sync_step = self.step
            self._average_buffers()

    def _on_wire(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        device = self._collective_device
        return [t.to(device) for t in tensors] if device.type != "cpu" else tensors

    def _average_buffers(self) -> None:
        """Floating buffers (BatchNorm's running statistics) drift apart between syncs: average them."""
        model = self.unwrap()
        buffers = [b for b in model.buffers() if b.is_floating_point()]
        if not buffers:
            return
        flat = torch.cat([b.detach().reshape(-1).float() for b in buffers]).to(self._collective_device)
        dist.all_reduce(flat)
        flat /= self.num_replicas
        offset = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()

    def _report_sync(self, fragment: int, cost: SyncCost, seconds: float, blocked_s: float) -> None:
        if self.is_chief:
            self._reporter.synced(step=self.step, outer_step=self.outer_steps, fragment=fragment,
                                  fragments=len(self._fragments), bytes_sent=cost.bytes_sent,
                                  elements=cost.elements, seconds=seconds, blocked_s=blocked_s,
                                  dtype=self._sync_dtype)

    def settle(self) -> None:
        """The run's end: land the exchange in flight, sync every fragment that did not sync at this
        step, and put the global weights in every replica (a streamed fragment lands mixed with the
        replica's own), so the last evaluation, checkpoint and weights are global ones."""
        if self._fragments is None:
            return
        if self._in_flight is not None:
            self._land()
        for fragment in range(len(self._fragments)):
            if self._synced_at.get(fragment) != self.step:  # --elastic: a healed member counts for nothing
                self._sync(fragment, owed=self._elastic is not None)
        if len(self._fragments) > 1:
            self._global.copy_into(list(range(len(self._params))), self._params)

    # -- evaluation and checkpoints: the global weights -----------------------

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[nn.Module]:
        """Evaluation runs the global weights; the replica's own come back after it."""
        model = self.compute_model()
        if self._global is None:
            yield model
            return
        every = list(range(len(self._params)))
        own = [p.detach().clone() for p in self._params]
        self._global.copy_into(every, self._params)
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, value in zip(self._params, own):
                    p.copy_(value)

    def save(self, directory: Any, *, keep: int = 3, wait: bool = False, extra: Any = None) -> Any:
        """A checkpoint of the global weights. One fragment: written at a sync (the last one syncs
        first), so every replica's weights are the global ones and a resume is exact. Streamed
        fragments sync at different steps, so a checkpoint between the run's syncs does not force
        any (that would change the training): it lands the exchange in flight and writes the
        global weights; a resume starts every replica from them."""
        if len(self._fragments) == 1:
            self.settle()
        elif self._in_flight is not None:  # the run's last save comes after fit's settle()
            self._land()
        return super().save(directory, keep=keep, wait=wait, extra=extra)

    def _checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The global weights under the model's parameter names (buffers: this replica's, averaged
        at the last sync), and replica 0's inner optimizer state."""
        model = self.unwrap()
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        for (name, param), tensor in zip(model.named_parameters(), self._global.tensors):
            if name in state:
                state[name] = tensor.detach().to(param.dtype).clone()
        return state, self._optimizer_state()

    def _comm_state(self) -> dict[str, Any] | None:
        """The outer optimizer and every replica's inner optimizer state (gathered on the chief)."""
        inner = gather_states(self._optimizer_state(), rank=self.replica_id, members=self.num_replicas,
                              device=self._collective_device)
        return {"diloco": {"outer": self._global.state_dict(), "inner": inner, "sync_every": self.sync_every}}

    def _load_comm_state(self, saved: dict[str, Any] | None) -> None:
        """A diloco checkpoint: this replica's inner state and the outer optimizer. Another
        strategy's: every replica starts from its optimizer state, the outer momentum from zero."""
        state = (saved or {}).get("diloco")
        if state is None:
            return
        self._global.load_state_dict(state["outer"], lr=self._outer_lr, momentum=self._outer_momentum)
        inner = state.get("inner") or []
        if inner:  # a job resumed on more replicas than wrote it: they share the states round-robin
            self._load_optimizer_state(inner[self.replica_id % len(inner)])

    def _after_restore(self) -> None:
        self._global.load(self._params)
        self._synced_at = dict.fromkeys(range(len(self._fragments)), self.step)
        self.last_sync_step = self.step

    def close(self) -> None:
        self.settle()  # a custom loop's replicas end on the global weights too (fit's settled already)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        super().close()
