"""Elastic membership: when a rank is lost, the survivors form a new group and heal from a peer.

The shape is torch.distributed.elastic's and TorchFT's. Rounds of a rendezvous run
on a store that outlives every training process. A recovering or joining replica
heals from a live peer's memory by broadcast, not from disk. In a synchronous
data-parallel job every replica holds the whole state, so a survivor is a live
checkpoint.

How a round runs, on the store (keys under ``elastic/``):

- **Liveness.** Every member's watcher thread bumps ``alive/<id>`` (a counter) every
  :data:`BEAT_S`. A member whose counter has not moved for :data:`LOST_AFTER_S`, on the
  reader's own monotonic clock, is gone. Counters, not timestamps: hosts' clocks differ.
  SIGKILL, a dead host and a killed hung rank all look like this, and a rank busy
  computing does not, since its thread still beats.
- **Noticing.** A gloo collective cannot be aborted from its own process: ``abort()``
  and ``shutdown()`` left a blocked all-reduce waiting until its peer exited (torch
  2.13). Dropping a group does close its connections, and a peer blocked on it wakes at
  once. So a member whose collective failed drops its group (:meth:`Membership.drop_group`)
  before anything else. Its peers' collectives then fail, they drop theirs, and the
  failure spreads round the group in milliseconds. A member busy computing fails at its
  next collective, with no timeout to wait out.
- **Opening.** ``generation`` names the current round. The first member to notice a
  failure opens the next round with ``compare_set``, so every survivor joins the same
  one.
- **Arriving.** A member adds itself to ``g<N>/arrived`` and writes its id and its
  committed step.
- **Closing.** A round closes when every member still beating has arrived. The first
  member to see that freezes the member count with ``compare_set``, and everyone reads
  the same list. New ranks follow the old ids' order.
- **Healing.** Members may hold different committed steps: a rank that died late in an
  all-reduce can let some survivors finish the step and not others. The member with the
  highest step broadcasts its state to the rest over the new group, and every member
  goes on from it.

Nothing crosses as pickle: ids and steps are decimal strings on the store, and state is
tensors.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BEAT_S", "LOST_AFTER_S", "BelowMinimum", "LateForRound", "Membership", "Round", "heal"]

#: How often a member's watcher renews its beat and reads the generation.
BEAT_S = 0.05
#: A member whose beat is this old is lost (a few beats: a loaded host may skip one).
LOST_AFTER_S = 1.0
_PREFIX = "elastic/"


@dataclass(frozen=True)
class Round:
    """One closed round: this member's place in the new group."""

    generation: int
    rank: int
    world_size: int
    members: tuple[int, ...]  # member ids, in new-rank order
    steps: tuple[int, ...]  # each member's committed step, same order

    @property
    def source(self) -> int:
        """The new rank that heals the others: the highest committed step (lowest rank on ties)."""
        best = max(self.steps)
        return self.steps.index(best)


class Membership:
    """One member's view of the job's rounds (every training process holds one).

    ``store_factory`` makes a client of the store that outlives training processes; the
    watcher thread gets a client of its own, so a blocked call on one never holds the
    other.
    """

    def __init__(self, store_factory: Callable[[], Any], member_id: int, *, timeout: timedelta) -> None:
        self.member_id = member_id
        self._store = dist.PrefixStore(_PREFIX, store_factory())
        self._watch_store = dist.PrefixStore(_PREFIX, store_factory())
        self._timeout = timeout
        self.generation = 0
        self.group: Any = None  # the current round's ProcessGroupGloo
        self._beats = 0
        self._last_seen: dict[int, tuple[str, float]] = {}  # member -> (its counter, when it last moved)
        self._stop = threading.Event()
        self._store.compare_set("generation", "", "0")  # only the first member's write takes
        self._beat()
        self._register()
        self._watcher = threading.Thread(target=self._watch, name="distrun-membership", daemon=True)
        self._watcher.start()

    # -- liveness and the watcher

    def _beat(self, store: Any = None) -> None:
        self._beats += 1
        (store or self._store).set(f"alive/{self.member_id}", str(self._beats))

    def _watch(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat(self._watch_store)
            except RuntimeError:  # the store is gone: the job is ending
                return

    def drop_group(self) -> None:
        """Close the current group's connections, so peers blocked on it fail now.

        The caller must have dropped its own references to the group first (a DDP
        wrapper holds one): connections close when the last reference goes.
        """
        group, self.group = self.group, None
        if group is not None:
            group.abort()
            del group
            gc.collect()

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(timeout=2.0)
        self.drop_group()

    # -- rounds

    def open_round(self) -> int:
        """Open the round after ours, or find the one another member opened; its generation."""
        # compare_set answers with the value now stored: ours if we opened the round, the
        # newer one if another member did first.
        return int(self._store.compare_set("generation", str(self.generation), str(self.generation + 1)).decode())

    def join_round(self, generation: int, committed_step: int, *, min_members: int = 1,
                   expect: int = 0) -> Round:
        """Arrive in round ``generation``, wait until it closes, and open its group (``self.group``).

        ``expect``: the round does not close before this many have arrived (the first
        round, while members are still starting); its live members still close it later.
        """
        key = f"g{generation}/"
        index = int(self._store.add(key + "arrived", 1)) - 1
        self._store.set(f"{key}member/{index}", f"{self.member_id} {committed_step}")
        deadline = time.monotonic() + self._timeout.total_seconds()
        count = self._wait_closed(key, deadline, expect)
        if index >= count:
            raise LateForRound(f"member {self.member_id} arrived after round {generation} closed")
        rows = [self._store.get(f"{key}member/{i}").decode().split() for i in range(count)]
        arrived = sorted((int(member), int(step)) for member, step in rows)
        if len(arrived) < min_members:
            raise BelowMinimum(f"{len(arrived)} member(s) left, fewer than the minimum {min_members}")
        members = tuple(member for member, _ in arrived)
        rank = members.index(self.member_id)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(key + "pg/", self._store), rank, len(members),
                                           self._timeout)
        self.generation = generation
        return Round(generation, rank, len(members), members, tuple(step for _, step in arrived))

    def _wait_closed(self, key: str, deadline: float, expect: int) -> int:
        """The round's frozen member count, freezing it ourselves once every live member arrived."""
        while True:
            frozen = self._read_int(self._store, key + "closed", default=-1)
            if frozen >= 0:
                return frozen
            arrived = self._read_int(self._store, key + "arrived")
            here = {int(self._store.get(f"{key}member/{i}").decode().split()[0]) for i in range(arrived)
                    if self._store.check([f"{key}member/{i}"])}
            if len(here) >= expect and self._live_members() <= here:
                self._store.compare_set(key + "closed", "", str(arrived))
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"round {key[:-1]}: live members did not arrive: "
                                   f"{sorted(self._live_members() - here)}")
            time.sleep(BEAT_S / 2)

    def _live_members(self) -> set[int]:
        now = time.monotonic()
        live = set()
        for member in self._known_members():
            beat = self._store.get(f"alive/{member}").decode()
            seen = self._last_seen.get(member)
            if seen is None or seen[0] != beat:
                self._last_seen[member] = seen = (beat, now)
            if now - seen[1] < LOST_AFTER_S:
                live.add(member)
        return live

    def _known_members(self) -> list[int]:
        """Every member id that has ever beaten (ids are registered once, in ``members``)."""
        raw = self._store.get("members").decode() if self._store.check(["members"]) else ""
        return [int(part) for part in raw.split(",") if part]

    def _register(self) -> None:
        """Add this member's id to ``members`` (once: at start, or on joining)."""
        while True:
            current = self._store.get("members").decode() if self._store.check(["members"]) else ""
            ids = [part for part in current.split(",") if part]
            if str(self.member_id) in ids:
                return
            updated = ",".join([*ids, str(self.member_id)])
            if self._store.compare_set("members", current, updated).decode() == updated:
                return

    @staticmethod
    def _read_int(store: Any, key: str, default: int = 0) -> int:
        if not store.check([key]):
            return default
        raw = store.get(key).decode()
        return int(raw) if raw else default


class LateForRound(RuntimeError):
    """This member arrived after the round closed: it joins the next one (as a joiner)."""


class BelowMinimum(RuntimeError):
    """Fewer members than ``--elastic MIN`` are left: the job falls back to a restart."""


def heal(membership: Membership, round_: Round, tensors: list[torch.Tensor]) -> None:
    """Make every member's ``tensors`` (same shapes everywhere, CPU) the source member's, by broadcast."""
    if round_.world_size == 1 or not tensors:
        return
    for tensor in tensors:
        membership.group.broadcast(tensor, round_.source).wait()
