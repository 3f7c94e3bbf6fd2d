"""``--elastic`` under diloco: members change at syncs, and no committed outer step is lost.

The rounds, liveness and heal are elastic training's own (strategies/elastic); what differs
is what a member commits. Between syncs a DiLoCo replica exchanges nothing, so its progress
is its own until the next sync, and the job's committed state is the global weights of the
last sync. So:

- **A member's committed step is its last sync's step** (its beats and its arrival in a
  round carry it). Members that synced last at the same step arrive "in step": each keeps
  its own weights and inner optimizer state, and the survivors of a lost replica go on
  without waiting for it, losing only its inner steps since that sync.
- **A failed sync is owed, not lost.** A replica that dies mid-period is noticed at the next
  sync, whose collective fails. The survivors form a new round and redo that sync among
  themselves before their next step (``owes_sync``): the outer step is taken, over their
  pseudo-gradients only.
- **A joiner waits for a sync.** Members propose to switch to a joiner's round at their next
  sync boundary, not their next step (they step apart between syncs, so only a sync bounds
  how far ahead one is). After that sync every member holds the global weights; the joiner
  is healed from the member with the newest sync: its step, data position, inner optimizer
  state, the global weights and the outer momentum. Its own weights start as the global ones.
- **A member cut off and back later is fenced out until it rejoins**: its old group is gone,
  its sync fails, and it arrives in the next round as a joiner with an older last sync, so
  it is healed like one. The members that were not behind keep their own weights and state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from distrun.strategies.elastic.heal import heal

__all__ = ["ElasticSyncs"]


class ElasticSyncs:
    """The elastic part of DiLoCoStrategy (a mixin before ``Strategy``: it uses their state)."""

    _elastic: Any
    _replica: Any
    _reporter: Any
    _dataset: Any
    _step: Any
    _global: Any
    _wire: Any
    _params: list[torch.nn.Parameter]
    _collective_device: torch.device
    healed_into_owed_sync: bool
    _committed_position: tuple[int, int]
    _healed_position: tuple[int, int] | None
    joined: bool
    _synced_at: dict[int, int]
    last_sync_step: int
    sync_every: int
    step: int
    is_chief: bool

    def _switch_boundary(self) -> int | None:
        """A joiner's round is switched to after the next sync (never one a member may have passed)."""
        return (self.step // self.sync_every + 1) * self.sync_every

    def owes_sync(self) -> bool:
        """A sync fell on this step and a change of membership interrupted it: the new group redoes it."""
        return self.step > 0 and self.step % self.sync_every == 0 and self.last_sync_step != self.step

    def _committed(self) -> None:
        if self._dataset is not None:
            self._committed_position = self._dataset.position
        change = self._elastic.committed(self.last_sync_step)  # a beat carries the newest committed outer step
        if change is not None:  # the group that went on from the last sync, said once by its chief
            self._reporter.membership(dataclasses.replace(change, step=self.last_sync_step), report=self.is_chief)

    def _recover_once(self, failed_at: float, *, switch: bool) -> None:
        """One try of ``recover`` (``ElasticReplica``'s, which tries again when a member is lost
        inside it): join the next round with this member's last sync, take the new group's
        size, heal who is behind."""
        round_ = self._elastic.next_round(self._held_step(), failed_at, failed=not switch)
        self._replica = dataclasses.replace(self._replica, rank=round_.rank, world_size=round_.world_size)
        self._wire.regroup(members=round_.world_size, rank=round_.rank)
        self._heal()

    #: A heal that failed between its two collectives left this member, behind, with part of the source's state.
    _half_healed = False

    def _held_step(self) -> int:
        """The last sync whose global weights this member holds; -1 for a joiner not yet healed
        or a member half healed."""
        if self._half_healed or (self.joined and self._healed_position is None):
            return -1
        return self.last_sync_step

    def _release_model(self) -> None:
        """Nothing belongs to the old group: the wire takes the new one's size in ``recover``."""

    def _restore(self, own: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, value in zip(self._params, own):
                p.copy_(value)

    def _heal(self) -> None:
        round_ = self._elastic.round
        if round_.in_step:  # every member synced last at the same step: each keeps its own progress
            self._resplit(round_, self._committed_position)
            return
        behind = self._held_step() < max(round_.steps)
        own = None if behind else [p.detach().clone() for p in self._params]
        values = None
        try:
            values = heal(self._elastic.membership.store, f"g{round_.generation}/heal", source=round_.source,
                          rank=round_.rank, model=self.unwrap(), optimizer_state=self._optimizer_state(),
                          load_optimizer_state=self._load_optimizer_state if behind else (lambda state: None),
                          device=self._collective_device, round_ended=self._elastic.membership.round_ended,
                          values={"step": self.step, "position": list(self._committed_position),
                                  "scaler": self._step.scaler_state(), "last_sync_step": self.last_sync_step,
                                  "outer_steps": self._global.outer_steps})
            self._global.broadcast(round_.source, self._collective_device)
        except Exception:
            # Two collectives: a member lost between them leaves this one with the source's
            # weights (and, behind, its optimizer state) from the first, beside its own global
            # weights. One that was not behind puts its own weights back; one behind holds no
            # whole state now, so it claims none (-1) and the recovery tried again (``recover``)
            # heals it again, or falls back to a restart where no member holds the job's state.
            if own is not None:
                self._restore(own)
            elif values is not None:
                self._half_healed = True
            raise
        self._half_healed = False
        every = list(range(len(self._params)))
        if behind:  # a joiner (or a member fenced out and back) starts from the global weights
            self._global.copy_into(every, self._params)
            self.healed_into_owed_sync = True  # its pseudo-gradient is zero: an owed sync must not count it
            self.step = int(values["step"])
            self._step.load_scaler_state(values["scaler"])
            self.last_sync_step = int(values["last_sync_step"])
            self._global.outer_steps = int(values["outer_steps"])
            self._synced_at = {0: self.last_sync_step}  # --elastic runs one fragment
        else:  # the heal's model broadcast reached every member: put this one's own weights back
            self._restore(own)
        self._resplit(round_, (int(values["position"][0]), int(values["position"][1])))
