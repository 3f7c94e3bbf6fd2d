"""``--elastic MIN[:MAX]``: a synchronous job that loses a replica, or gains one, loses no step.

The strategy side of elastic training; the rounds themselves are ``membership``'s and
the state transfer ``heal``'s. A strategy that holds an :class:`Elastic`:

- raises :class:`MembershipSwitch` at a step boundary when a joiner waits for a round
  (``switch_due``), before the step starts;
- on a failed collective or that switch, ``Strategy.recover`` drops its DDP wrapper and
  its group, joins the next round (:meth:`Elastic.next_round`), heals from the member
  with the most committed steps and rebuilds DDP over the new group;
- the training loop then iterates its data again: the position was healed from the
  committed step, and the global batches are split over the new count, so the step
  that failed is redone with the same samples.

What counts as a change of membership, rather than the recipe's error: a joiner's switch;
or an error of the process group's own types (torch's ``DistError`` family: backend, network,
store) or a plain ``RuntimeError`` (what gloo raises when a peer is gone), while the
membership record says the round is over: a peer marked lost or silent, or another member's
failed round (``Membership.round_over``). Never the text of an exception, and never its type
alone: a recipe's own ``RuntimeError("... Connection refused ...")`` with every peer alive
fails the job and names its line, and so does a backend error that recurs with every peer
alive (a gloo size mismatch once recovered and failed forever: 84fc936).

A member that finds its own connection to the store broken (a partition longer than TCP
resends for: the store's host gave up on it) cannot rejoin from this process, since torch's
store client never reconnects. It raises :class:`CutOff`; the process leaves with
``CUT_OFF_EXIT_CODE``, no failure, and its launcher starts it again as a joiner.

Recoveries are capped twice: a change of membership met inside a recovery is tried again up
to ``RECOVERY_TRIES`` times, and ``RECOVERIES_WITHOUT_PROGRESS`` recoveries in a row with no
step committed between them fail the member (:class:`NoProgress`), naming the last cause.

Why the model is held by an :class:`ElasticModel`: the recipe (or distrun's fit loop)
keeps the object ``prepare`` returned, while DDP must be rebuilt over each new group.
The holder stays, and its inner DDP is replaced.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from distrun.strategies.elastic.heal import heal
from distrun.strategies.elastic.membership import BEAT_S, JobFinished, LateForRound, Membership, Round

__all__ = ["CutOff", "one_line", "Elastic", "ElasticModel", "ElasticReplica", "MembershipChange", "MembershipSwitch", "NoProgress",
           "RECOVERIES_WITHOUT_PROGRESS", "RECOVERY_TRIES", "is_collective_failure"]

#: Recoveries in a row before a change of membership fails this member (and the job).
RECOVERY_TRIES = 3
#: Recoveries (each up to ``RECOVERY_TRIES`` tries) with no committed step between them before
#: the member fails: a failure that recurs on every step is not healed by one more round. The
#: longest run seen in the chaos test was 2 (a link dropped right after a rejoin).
RECOVERIES_WITHOUT_PROGRESS = 5


class NoProgress(RuntimeError):
    """Recovery after recovery, and no step committed between them: the member gives up."""


class CutOff(RuntimeError):
    """This member's store connection is broken: the job went on without it, and only a new
    process (its launcher starts one, as a joiner) can come back."""


def one_line(exc: BaseException) -> str:
    """``Type: first line``: torch's errors run on with C++ frames; a cause is named by its head."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def cut_off(exc: BaseException, membership: Membership) -> CutOff | None:
    """``exc``, a change of membership met while recovering, as :class:`CutOff` where this
    member's own store client no longer answers (every further try would fail alike)."""
    if membership.store_answers():
        return None
    return CutOff(f"cut off from the job: its connection to the store broke ({one_line(exc)})")


class MembershipSwitch(RuntimeError):
    """A member is waiting to join: every member leaves its group at this step boundary."""


class ElasticModel(nn.Module):
    """The prepared model under ``--elastic``: its DDP is rebuilt at each round, this object stays."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


@dataclass(frozen=True)
class MembershipChange:
    """One round that changed the group, as the ``membership`` event says it."""

    generation: int
    step: int  # the committed step the members went on from
    world_size: int
    left: tuple[str, ...]
    joined: tuple[str, ...]
    recovery_s: float  # from the failure (or the switch) to the next committed step
    steps_lost: int  # committed steps some member of the old group beat that the new group does not hold


def is_collective_failure(exc: BaseException, membership: Membership) -> bool:
    """A collective failed because a peer is gone (or a joiner asked for a switch): decided
    by the exception's type and the membership record, never by its text."""
    if isinstance(exc, MembershipSwitch):
        return True
    if not isinstance(exc, getattr(dist, "DistError", ())) and type(exc) is not RuntimeError:
        return False
    return membership.round_over()


class Elastic:
    """One replica's elastic membership, as its strategy uses it."""

    def __init__(self, membership: Membership, *, min_members: int, max_members: int, expect: int) -> None:
        self.membership = membership
        self.min_members = min_members
        self.max_members = max_members
        self._expect = expect  # the first round waits for the launch's world size
        self.round: Round | None = None
        # (since, round, before, lost, also): ``also``, members of rounds that closed since the group
        # that last trained but never formed (a joiner lost as it formed): they left too.
        self._pending: tuple[float, Round, tuple[int, ...], int, tuple[int, ...]] | None = None

    def first_round(self) -> Round:
        """Join the job: the first round of a fresh job, or the next one for a joiner.

        A joiner calls this once its model and optimizer are built (``Strategy.prepare``):
        the members already training wait in the round for it, so it arrives ready.
        """
        if not self.membership.joiner:
            self.round = self.membership.join_round(0, 0, expect=self._expect)
            return self.round
        failures = 0
        opened = None
        while True:
            if opened is None:
                self._wait_for_a_place()
                opened = self.membership.open_joiners_round()
            try:
                self.round = self.membership.join_round(opened, -1, patient=True)
            except LateForRound:  # the round closed as we arrived: open the next
                opened = None
                continue
            except Exception as exc:  # noqa: BLE001 - only a change of membership is tried again
                # Another member lost while our first group formed: the others go on to the
                # next round (``next_round``) and wait there for us, a live member; so do we.
                failures += 1
                if not is_collective_failure(exc, self.membership):
                    raise
                lost = cut_off(exc, self.membership)
                if lost is not None:
                    raise lost from None
                if failures == RECOVERY_TRIES:
                    raise
                self.membership.drop_group()
                opened = self.membership.open_round(failed=True)
                continue
            self._pending = (time.monotonic(), self.round, (), 0, ())
            return self.round

    def _wait_for_a_place(self) -> None:
        """A joiner waits while the job already runs ``max_members`` replicas (or ends)."""
        while self.membership.current_size() >= self.max_members:
            if self.membership.finished():
                raise JobFinished("the job finished while this member waited for a place")
            time.sleep(BEAT_S * 4)

    def switch_due(self, committed_step: int, boundary: int | None = None) -> bool:
        return self.membership.switch_due(committed_step, boundary)

    def next_round(self, committed_step: int, failed_at: float, *, failed: bool) -> Round:
        """Leave the group (the caller dropped its DDP first), join the next round, open its group.

        ``failed``: a collective failed (not a joiner's switch): members still blocked in the
        old group are woken.
        """
        before = self.round.members if self.round is not None else ()
        also: tuple[int, ...] = ()
        if self._pending is not None and self._pending[2]:  # a recovery tried again: report the change
            failed_at, before, also = self._pending[0], self._pending[2], self._pending[4]  # from the group that last trained
        also += tuple(m for m in self.membership.closed_members if m not in before and m not in also)
        self.membership.drop_group()
        opened = self.membership.open_round(failed=failed)
        late = False
        while True:
            try:
                new = self.membership.join_round(opened, committed_step, min_members=self.min_members,
                                                 patient=late)
                break
            except LateForRound:
                # The round closed without us: our beat looked lost (a starved host, a dropped
                # link), or a joiner's round closed as we arrived. Join the next one, as a joiner
                # does; the others switch to it at a boundary and heal whoever is behind.
                opened, late = self.membership.open_joiners_round(), True
        self.round = new
        # Every member's beat carries its newest committed step, a lost member's too: the
        # steps the new group lost are those beyond the step it heals to (0 by design).
        highest = max((self.membership.last_committed(member) for member in before), default=-1)
        self._pending = (failed_at, new, before, max(0, highest - max(new.steps)), also)
        return new

    def committed(self, step: int) -> MembershipChange | None:
        """After a committed step: the change that led here, once (the chief reports it)."""
        self.membership.committed_step = step
        if self._pending is None:
            return None
        failed_at, new, before, lost, also = self._pending
        self._pending = None
        describe = self.membership.describe
        return MembershipChange(
            generation=new.generation, step=step - 1, world_size=new.world_size,
            left=tuple(f"{describe(m)} ({self.membership.why_lost(m)})" for m in before + also if m not in new.members),
            joined=tuple(describe(m) for m in new.members if before and m not in before),
            recovery_s=time.monotonic() - failed_at,
            steps_lost=lost,
        )

    def mark_finished(self) -> None:
        """The job's last step is done: a joiner still waiting for a round leaves (``JobFinished``)."""
        self.membership.mark_finished()

    def close(self, *, finished: bool = False) -> None:
        self.membership.close(finished=finished)


class ElasticReplica:
    """A strategy's elastic part (a mixin of ``Strategy``: it uses its state).

    ``Strategy.run`` calls :meth:`_committed` after each step; the fit loop calls
    :meth:`is_membership_change` and :meth:`recover`. Strategies that support
    ``--elastic`` (mirrored, multi-worker) implement ``_release_model`` and
    ``_rebuild_model``. It also uses the strategy's ``unwrap``, ``_optimizer_state``,
    ``_load_optimizer_state``, ``_collective_device`` and ``is_chief``. A mixin keeps
    base.py to the API every strategy shares.
    """

    _elastic: Elastic | None
    _replica: Any
    _dataset: Any
    _step: Any
    _reporter: Any
    _committed_position: tuple[int, int]
    _healed_position: tuple[int, int] | None
    _recoveries_in_a_row: int
    lr_schedule: Any
    #: The learning-rate schedule's state a heal brought (a joiner heals before its schedule is built:
    #: the fit loop loads this into it then); None where no heal carried one.
    healed_lr_schedule: dict[str, Any] | None = None
    #: The recipe's callbacks' state as their checkpoints keep it (``{"callbacks": {...}}``): the fit loop
    #: sets these once it has built them, so a heal carries it (EarlyStopping's count, a custom
    #: callback's own); ``healed_callbacks`` is what a heal brought, for a joiner that heals before
    #: its callbacks exist (the fit loop loads it into them then).
    callbacks_state: Callable[[], dict[str, Any]] | None = None
    load_callbacks_state: Callable[[dict[str, Any] | None], None] | None = None
    healed_callbacks: dict[str, Any] | None = None
    step: int
    epoch: int
    name: str

    @property
    def joined(self) -> bool:
        """This replica joined a job already training: its state came from a peer, not a checkpoint."""
        return self._elastic is not None and self._elastic.membership.joiner

    def is_membership_change(self, exc: BaseException) -> bool:
        """Under ``--elastic``: ``exc`` means a peer is gone or joins, and :meth:`recover` goes on."""
        return self._elastic is not None and is_collective_failure(exc, self._elastic.membership)

    def recover(self, failed_at: float, *, switch: bool = False, cause: str = "") -> None:
        """Go on after a change of membership, from the state the members hold in memory.

        Drop the group, join the next round, put DDP on the new group, then heal model,
        optimizer, step, data position and loss scale from the member with the most
        committed steps (nothing, where every member committed the same step). The caller
        iterates its data again: the step that failed is redone, split over the new count. Below ``--elastic MIN`` the
        round raises ``BelowMinimum`` and the job falls back to a restart. ``switch``: no
        collective failed; a joiner asked for the new round (:class:`MembershipSwitch`).

        Another change inside the recovery (a member lost in its round, its group or its heal)
        is recovered from in turn, up to ``RECOVERY_TRIES`` in a row (then the member fails, and
        with it the job): a heal that fails changes no member's state (``heal.broadcast_tensors``),
        so each try starts from what the members committed. Seen in the chaos test: a link
        dropped right after a rejoin ended the job.

        ``cause``: the failure's one-line description, named if this recovery is the
        ``RECOVERIES_WITHOUT_PROGRESS``-th in a row with no step committed since the first.
        """
        if self._elastic is None:
            raise RuntimeError("recover() is for --elastic jobs")
        self._recoveries_in_a_row += 1
        if self._recoveries_in_a_row > RECOVERIES_WITHOUT_PROGRESS:
            raise NoProgress(f"{RECOVERIES_WITHOUT_PROGRESS} recoveries in a row and no step committed at step "
                             f"{self.step + 1}; the last failure: {cause or 'a joiner asked for a new round'}")
        for tried in range(1, RECOVERY_TRIES + 1):
            try:
                self._recover_once(failed_at, switch=switch)
                return
            except Exception as exc:  # noqa: BLE001 - only a change of membership is tried again
                if not self.is_membership_change(exc):
                    raise
                lost = cut_off(exc, self._elastic.membership)
                if lost is not None:
                    raise lost from None
                if tried == RECOVERY_TRIES:
                    raise
            switch = False  # the next try follows a failure, not a joiner's switch

    def _recover_once(self, failed_at: float, *, switch: bool) -> None:
        assert self._elastic is not None
        self._release_model()
        round_ = self._elastic.next_round(self._held_step(), failed_at, failed=not switch)
        self._replica = dataclasses.replace(self._replica, rank=round_.rank, world_size=round_.world_size)
        self._rebuild_model(round_)
        self._heal()

    def _held_step(self) -> int:
        """The committed step whose state this member holds; -1 for a joiner not yet healed (it
        holds the recipe's first parameters, which no round may heal from)."""
        return -1 if self.joined and self._healed_position is None else self.step

    def _heal_joiner(self) -> None:
        """A joiner's first heal (``prepare``). A member lost during it is a change of membership
        like any other: the joiner recovers with the rest, holding nothing yet."""
        try:
            self._heal()
            return
        except Exception as exc:  # noqa: BLE001 - only a change of membership is recovered from
            if not self.is_membership_change(exc):
                raise
        self.recover(time.monotonic())  # outside the except: the failed group's last references go

    def _heal(self) -> None:
        elastic = self._elastic
        assert elastic is not None and elastic.round is not None
        round_ = elastic.round
        if round_.in_step:  # the same committed step everywhere: the same state (every member decides alike)
            self._resplit(round_, self._committed_position)
            return
        values = heal(elastic.membership.store, f"g{round_.generation}/heal", source=round_.source,
                      rank=round_.rank, model=self.unwrap(), optimizer_state=self._optimizer_state(),
                      load_optimizer_state=self._load_optimizer_state, device=self._collective_device,
                      round_ended=elastic.membership.round_ended,
                      values={"step": self.step, "position": list(self._committed_position),
                              "scaler": self._step.scaler_state(),
                              "lr_schedule": self.lr_schedule.state_dict() if self.lr_schedule is not None else None,
                              "callbacks": self.callbacks_state() if self.callbacks_state is not None else None})
        behind = int(values["step"]) != self.step or self._held_step() < 0  # a joiner, or a step short
        self.step = int(values["step"])
        self._step.load_scaler_state(values["scaler"])
        self.healed_lr_schedule = values.get("lr_schedule")
        if self.lr_schedule is not None:  # the source's, skipped steps and all (a count would miss them)
            self.lr_schedule.load_state_dict(self.healed_lr_schedule, self.step)
        self.healed_callbacks = values.get("callbacks")
        # Only where this member's callbacks saw other steps than the source's: loading clears what a
        # callback holds outside its state (EarlyStopping's kept best weights), which the rest keep.
        if behind and self.load_callbacks_state is not None and self.healed_callbacks is not None:
            self.load_callbacks_state(self.healed_callbacks)
        self._resplit(round_, (int(values["position"][0]), int(values["position"][1])))

    def _resplit(self, round_: Any, position: tuple[int, int]) -> None:
        """The same global batches over the new count, from ``position`` (the committed one)."""
        self._healed_position = self._committed_position = position
        if self._dataset is not None:
            self._dataset.reshard(round_.world_size, round_.rank, redo_last=False)
            self._dataset.seek(*position)
            self.epoch = position[0]

    def _committed(self) -> None:
        assert self._elastic is not None
        if self._dataset is not None:
            self._committed_position = self._dataset.position
        change = self._elastic.committed(self.step)
        if change is not None:
            self._reporter.membership(change, report=self.is_chief)

    def _release_model(self) -> None:
        """Let go of what belongs to the old group (hook state), before it is dropped."""
        raise NotImplementedError(f"--elastic: the {self.name} strategy cannot change membership")

    def _rebuild_model(self, round_: Any) -> None:
        """Wrap the model again over ``round_``'s group (after ``_release_model``)."""
        raise NotImplementedError(f"--elastic: the {self.name} strategy cannot change membership")
