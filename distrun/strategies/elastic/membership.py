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
  next collective, with no timeout to wait out. That spread is not enough alone: on
  three namespace hosts, a member stayed blocked in DDP's all-reduce after both its
  peers had gone (one killed, one dropped its group), 3 runs in 4. So a member that
  notices a failure marks its round (``g<N>/failed``), and every member's watcher
  that sees the mark while still in the old group shuts down the old group's sockets
  (found by which sockets ``init_process_group`` opened), which wakes its own blocked
  collective at once.
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

- **Joining.** A new member (a restarted rank, a new host) opens the round after the
  store's current one and waits in it. Members in training read the generation once per
  step; the first to see a newer one proposes a switch at the step after its own next
  one (``g<N>/switch_after``, set once), and every member leaves its group at that
  boundary and arrives. No member can be past that boundary when the proposal is
  written, since the step before it needs the proposer. So a join costs no failed step.

The round's group is torch.distributed's default group (``init_process_group`` on a
prefix of the store), so DDP, ``dist.all_reduce`` and every strategy's collectives use
it unchanged.

Nothing crosses as pickle: ids and steps are decimal strings on the store, and state is
tensors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distrun.strategies.elastic.group_sockets import GroupSockets, socket_fds

__all__ = ["BEAT_S", "LOST_AFTER_S", "JOINER_IDS", "STORE_PREFIX", "BelowMinimum", "JobFinished", "LateForRound",
           "Membership", "Round"]

#: How often a member's watcher renews its beat and reads the generation.
BEAT_S = 0.05
#: A member whose beat is this old is lost: twenty beats. Measured: at 0.3 s, three ranks
#: starting on a loaded 2-core host missed six beats in a row, and a live rank was taken
#: for lost at step 1.
LOST_AFTER_S = 1.0
#: Every membership key lives under this prefix (a PrefixStore: "elastic/" + "/" + key).
STORE_PREFIX = "elastic/"
#: Member ids of joiners start here, so they sort after every first member (new ranks follow ids).
JOINER_IDS = 1_000_000


@dataclass(frozen=True)
class Round:
    """One closed round: this member's place in the new group."""

    generation: int
    rank: int
    world_size: int
    members: tuple[int, ...]  # member ids, in new-rank order
    steps: tuple[int, ...]  # each member's committed step, same order

    @property
    def in_step(self) -> bool:
        """Every member committed the same step, and none is new: under DDP they hold the same
        state already (the same averaged gradients, the same optimizer steps), so nothing is healed."""
        return len(set(self.steps)) == 1 and self.steps[0] >= 0

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

    def __init__(self, store_factory: Callable[[], Any], member_id: int | None, *, timeout: timedelta,
                 backend: str = "gloo", device: torch.device | None = None, who: str = "",
                 launch_rank: int | None = None, incarnation: str = "0") -> None:
        """``member_id``: the launcher's rank for a first member; None for a joiner (a
        restarted rank, a new host), which takes a fresh id from the store.
        ``backend``/``device``: the default group each round opens (gloo, or nccl and its GPU).
        ``who``: how events name this member ("rank 2 on 10.0.0.3"). ``launch_rank`` and
        ``incarnation``: which start of which launcher rank this is, unique across launchers
        (``runtime/_process.incarnation_id``): its launcher's agent marks exactly that one lost
        when it dies (``elastic/lost/RANK/INCARNATION``)."""
        self._store_factory = store_factory
        self._store = dist.PrefixStore(STORE_PREFIX, store_factory())
        self._watch_store = dist.PrefixStore(STORE_PREFIX, store_factory())
        if member_id is None:
            member_id = JOINER_IDS + int(self._store.add("joiners", 1))
        self.member_id = member_id
        self._timeout = timeout
        self._backend = backend
        self._device = device
        self.generation = 0  # the round whose group this member is in
        self._arrived = 0  # the newest round it arrived in (>= generation: its group may not have formed)
        self.closed_members: tuple[int, ...] = ()  # the members of the newest round it saw close
        self.committed_step = 0  # the strategy's newest committed step; each beat carries it
        self._beats = 0
        self._last_seen: dict[int, tuple[str, float]] = {}  # member -> (its counter, when it last moved)
        self._round_peers: tuple[int, ...] = ()  # the other members of our round (the watcher reads their beats)
        self._sockets = GroupSockets(backend, device)  # the current group's connections
        self._round_over = threading.Event()  # the record says our round is over (a peer lost, a round failed)
        self._read_at = time.monotonic()  # when the watcher last had an answer from the store
        self._stop = threading.Event()
        self._store.compare_set("generation", "", "0")  # only the first member's write takes
        self._store.set(f"who/{member_id}", who or f"member {member_id}")
        if launch_rank is not None:
            self._store.set(f"ident/{member_id}", f"{launch_rank} {incarnation}")
        self._marks: dict[int, str | None] = {}  # member -> its lost mark's key (None: no launcher rank)
        self._lost_count = 0  # elastic/lost_count as the watcher last read it
        self._beat()
        if not self.joiner:  # a joiner registers as it arrives: a round must not wait for it before
            self._register()
        self._watcher = threading.Thread(target=self._watch, name="distrun-membership", daemon=True)
        self._watcher.start()

    @property
    def store(self) -> Any:
        """The store under this job's ``elastic/`` prefix (healing writes its manifest here)."""
        return self._store

    @property
    def joiner(self) -> bool:
        return self.member_id >= JOINER_IDS

    def last_committed(self, member: int) -> int:
        """The newest committed step ``member`` beat (a lost member's is its last word)."""
        key = f"alive/{member}"
        if not self._store.check([key]):
            return -1
        return int(self._store.get(key).decode().split()[1])

    def why_lost(self, member: int) -> str:
        """What its launcher's agent said when it died ("killed by SIGKILL"), else that its beat stopped."""
        if self._marked_lost(member, self._store):
            mark = self._marks[member]
            assert mark is not None
            return self._store.get(mark).decode()
        return "its beat stopped: its host or launcher is gone"

    def describe(self, member: int) -> str:
        """How events name a member (its launcher rank and host)."""
        key = f"who/{member}"
        return self._store.get(key).decode() if self._store.check([key]) else f"member {member}"

    # -- liveness and the watcher

    def _beat(self, store: Any = None) -> None:
        self._beats += 1
        (store or self._store).set(f"alive/{self.member_id}", f"{self._beats} {self.committed_step}")

    def _watch(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat(self._watch_store)
                newest = int(self._watch_store.get("generation").decode())
                if self._sockets:  # a group formed, or forming (the round we arrived in)
                    if newest > self._arrived and self._watch_store.check([f"g{newest}/failed"]):
                        self._round_over.set()
                        self._sockets.shut()  # another member's collective failed: ours is in the dead group
                    elif self._lost_peer():
                        self._round_over.set()
                        self._sockets.shut()  # a peer's beat stopped: fail now, not when a socket says so
                # Only now, the whole record read (a set has no answer; the reads above do):
                # round_over never takes a pass that has yet to check the record for current.
                self._read_at = time.monotonic()
            except RuntimeError:  # the store is gone: the job is ending
                return

    def _marked_lost(self, member: int, store: Any) -> bool:
        """Its launcher's agent said this member died (``launch/_agent``): no need to wait for its beat."""
        if member not in self._marks:
            key = f"ident/{member}"
            if not store.check([key]):
                return False  # not registered yet: ask again next time
            rank, incarnation = store.get(key).decode().split()
            self._marks[member] = f"lost/{rank}/{incarnation}"
        mark = self._marks[member]
        return mark is not None and store.check([mark])

    def _lost_peer(self) -> bool:
        """Whether a member of our round stopped beating (one ``multi_get`` for all of them).

        A dead peer's sockets do not always tell: on namespace hosts a survivor noticed a
        SIGKILLed peer half a second late, or not at all. Its beat is the sure sign. What
        is seen here is what the next round's closing reads (``_last_seen``), so a peer
        already stale by then does not cost another ``LOST_AFTER_S``.
        """
        peers = self._round_peers
        if not peers:
            return False
        count = int(self._watch_store.add("lost_count", 0))
        if count != self._lost_count:  # an agent marked a death since we last looked: is it one of ours?
            self._lost_count = count
            if any(self._marked_lost(peer, self._watch_store) for peer in peers):
                return True
        now = time.monotonic()
        beats = self._watch_store.multi_get([f"alive/{peer}" for peer in peers])
        lost = False
        for peer, raw in zip(peers, beats):
            beat = raw.decode()
            last = self._last_seen.get(peer)
            if last is None or last[0] != beat:
                self._last_seen[peer] = (beat, now)
            elif now - last[1] > LOST_AFTER_S:
                lost = True
        return lost

    def round_over(self, wait_s: float = LOST_AFTER_S + 2.0) -> bool:
        """Whether the membership record says this member's round is over: a peer marked lost
        by its launcher's agent, a peer's beat stale for ``LOST_AFTER_S``, or another member's
        failed round. Waits up to ``wait_s`` for the watcher to see it (a peer's death reaches a
        socket before the record). False: every peer is alive, so a failure is not a change of
        membership.

        While the watcher cannot read the record (this member's own link was down, and TCP
        resends the waiting request seconds after it comes back), the record cannot say: then
        it waits until the watcher reads it again, up to the store's timeout. Seen in the chaos
        test: a peer's reset reached a member whose link had just come back, 3 s passed before
        its watcher read the store again, and the job ended on that member's "Connection reset
        by peer" instead of healing it. A watcher that ended (its store client failed) or never
        read within the timeout: the member is cut off from the job, which is a change of membership.
        A watcher already ended decides at once: its record will not change (it waited ``wait_s``
        for nothing, twice in a recovery, and a cancelled job's rank outlived the stop's first phase).
        """
        waited_until = time.monotonic() + wait_s
        while not self._round_over.wait(min(BEAT_S * 2, wait_s)):
            if not self._watcher.is_alive() or time.monotonic() >= waited_until:
                break
        if self._round_over.is_set():
            return True
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            if not self._watcher.is_alive():  # its store client failed: cut off, unless the store answers
                return not self._stop.is_set() and not self.store_answers()
            if time.monotonic() - self._read_at <= LOST_AFTER_S:  # a recent read: the record is current
                return self._round_over.is_set()
            if time.monotonic() > deadline or self._round_over.wait(BEAT_S):
                return True

    def round_ended(self) -> bool:
        """Whether the watcher has seen this member's round end (no wait: ``round_over`` waits)."""
        return self._round_over.is_set()

    def store_answers(self) -> bool:
        """Whether this member's own store client still gets an answer (then a recipe's error
        stays the recipe's, though the watcher ended). No: this member is cut off from the job
        for good (torch's store client does not reconnect), and only a new process can rejoin."""
        try:
            self._store.check(["generation"])
        except RuntimeError:
            return False
        return True

    def drop_group(self) -> None:
        """Leave this process's default group so that peers blocked on it fail now (``group_sockets``)."""
        self._sockets.drop()

    def mark_finished(self) -> None:
        """The job's last step is done; a joiner still waiting for a round leaves quietly
        (:class:`JobFinished`)."""
        self._store.set("finished", "1")

    def close(self, *, finished: bool = False) -> None:
        """Stop beating (``finished``: ``mark_finished`` first)."""
        if finished:
            self.mark_finished()
        self._stop.set()
        self._watcher.join(timeout=2.0)

    # -- rounds

    def current_size(self) -> int:
        """Members of the newest closed round (0 before the first closes)."""
        generation = int(self._store.get("generation").decode())
        for g in range(generation, -1, -1):
            count = self._read_int(self._store, f"g{g}/closed", default=-1)
            if count >= 0:
                return count
        return 0

    def finished(self) -> bool:
        return self._store.check(["finished"])

    def open_round(self, *, failed: bool = False) -> int:
        """Open the round after ours, or find the one another member opened; its generation.

        A member of the current round opens the round after its own, so survivors that
        notice one failure together all land in the same round. ``failed``: our group
        failed; mark the round, so members still blocked in it are woken (``_watch``).
        """
        # After the one we last arrived in (ours, or one whose group never formed: a member
        # lost while it formed): going back to that closed round would leave us late for it,
        # a joiner waiting on members who wait on us.
        mine = self._arrived
        # compare_set answers with the value now stored: ours if we opened the round, the
        # newer one if another member did first.
        generation = int(self._store.compare_set("generation", str(mine), str(mine + 1)).decode())
        if failed:
            self._store.set(f"g{generation}/failed", "1")
        return generation

    def open_joiners_round(self) -> int:
        """A joiner's round: the one after the newest, once the newest has closed.

        A joiner waits while a round is open (survivors forming a group after a failure),
        so the job first goes on without the lost member and then grows: 3 -> 2 -> 3, each
        change its own event. It registers only now, so no round waits for it earlier.
        """
        while True:
            newest = int(self._store.get("generation").decode())
            if self._store.check([f"g{newest}/closed"]):
                break
            if self.finished():
                raise JobFinished("the job finished while this member waited to join")
            time.sleep(BEAT_S)
        self._register()
        return int(self._store.compare_set("generation", str(newest), str(newest + 1)).decode())

    def switch_due(self, committed_step: int, boundary: int | None = None) -> bool:
        """At a step boundary: whether a round is waiting for us (a member joins) and it is time.

        One store read per step. The first member to see a newer round proposes the step
        to switch after: ``boundary``, by default its own next one (a synchronous step needs
        every member, so none can be past it). A strategy whose members step apart between
        collectives (diloco) proposes its next one instead. Everyone switches at that same
        boundary.
        """
        newest = int(self._store.get("generation").decode())
        if newest <= self.generation:
            return False
        proposal = committed_step + 1 if boundary is None else boundary
        agreed = int(self._store.compare_set(f"g{newest}/switch_after", "", str(proposal)).decode())
        return committed_step >= agreed

    def join_round(self, generation: int, committed_step: int, *, min_members: int = 1,
                   expect: int = 0, patient: bool = False) -> Round:
        """Arrive in round ``generation``, wait until it closes, and open its group (the default group).

        ``expect``: the round does not close before this many have arrived (the first
        round, while members are still starting); its live members still close it later.
        ``patient``: a joiner's round, which the members reach at their next switch boundary
        (under diloco, their next sync, possibly many minutes away): it waits past the
        timeout for as long as the members it waits for still beat.
        """
        key = f"g{generation}/"
        index = int(self._store.add(key + "arrived", 1)) - 1
        self._store.set(f"{key}member/{index}", f"{self.member_id} {committed_step}")
        self._arrived = max(self._arrived, generation)  # a recovery that fails from here on opens the next
        deadline = time.monotonic() + self._timeout.total_seconds()
        count = self._wait_closed(key, deadline, expect, patient=patient)
        if index >= count:
            raise LateForRound(f"member {self.member_id} arrived after round {generation} closed")
        rows = [self._store.get(f"{key}member/{i}").decode().split() for i in range(count)]
        arrived = sorted((int(member), int(step)) for member, step in rows)
        if len(arrived) < min_members:
            raise BelowMinimum(f"{len(arrived)} replica(s) left, fewer than --elastic MIN {min_members}; "
                               "the job falls back to --max-restarts (a restart from the newest checkpoint)")
        if max(step for _, step in arrived) < 0:  # only joiners: healing from one would start training over
            raise BelowMinimum(f"no replica left holds the job's state (the {len(arrived)} in round {generation} "
                               "all joined anew); the job falls back to --max-restarts (a restart from the "
                               "newest checkpoint)")
        members = tuple(member for member, _ in arrived)
        self.closed_members = members
        rank = members.index(self.member_id)
        before = socket_fds()
        # The group forms over a store client of its own, watched from now on like the group's
        # connections: a member lost while it forms (a joiner killed as it arrived) gets it shut,
        # and init_process_group fails now instead of waiting for the lost member's address for
        # the store's whole timeout.
        forming = dist.PrefixStore(key + "pg/", self._store_factory())
        with self._sockets.lock:  # peers first: the watcher reads them once it sees connections
            self._round_peers = tuple(member for member in members if member != self.member_id)
            self._round_over.clear()
            self._sockets.formed(before)
        dist.init_process_group(self._backend, store=forming, rank=rank, world_size=len(members),
                                timeout=self._timeout, device_id=self._device if self._backend == "nccl" else None)
        self.generation = generation
        with self._sockets.lock:  # the group's connections: what init_process_group opened
            self._sockets.formed(before)
        return Round(generation, rank, len(members), members, tuple(step for _, step in arrived))

    def _wait_closed(self, key: str, deadline: float, expect: int, *, patient: bool = False) -> int:
        """The round's frozen member count, freezing it ourselves once every live member arrived."""
        while True:
            frozen = self._read_int(self._store, key + "closed", default=-1)
            if frozen >= 0:
                return frozen
            if self._store.check(["finished"]):
                raise JobFinished("the job finished before this member's round closed")
            arrived = self._read_int(self._store, key + "arrived")
            here = {int(self._store.get(f"{key}member/{i}").decode().split()[0]) for i in range(arrived)
                    if self._store.check([f"{key}member/{i}"])}
            if len(here) >= expect and self._live_members() <= here:
                self._store.compare_set(key + "closed", "", str(arrived))
                continue

            if time.monotonic() > deadline:
                missing = self._live_members() - here
                if patient and missing:  # still training towards their boundary: wait on
                    deadline = time.monotonic() + self._timeout.total_seconds()
                    continue
                raise TimeoutError(f"round {key[:-1]}: live members did not arrive: {sorted(missing)}")
            time.sleep(BEAT_S / 2)

    def _live_members(self) -> set[int]:
        now = time.monotonic()
        live = set()
        for member in self._known_members():
            if self._marked_lost(member, self._store):
                continue
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


class JobFinished(RuntimeError):
    """A joiner waited for a round, and the job ended first: it has nothing to do."""
