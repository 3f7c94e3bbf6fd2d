"""A cluster job's hosts under ``--elastic``: lost hosts rejoin, added hosts join, hung ranks go.

A ``ClusterJob`` holds one :class:`ElasticHosts`, which acts on the job through the
:class:`ElasticJob` protocol: the members it reads and the calls it makes. So this module
never imports ``cluster_job`` (the two imported each other while this was a mixin). These
are the client's part of elastic training (docs/elastic.md); the ranks' part is
``strategies/elastic/replica.py``.

- ``--elastic MIN[:MAX]`` counts worker hosts, as torchrun's ``--nnodes`` does.
- A lost worker host (its server killed, the host down): the others go on; once its
  server answers again (``distrun up``), its ranks are submitted as joiners. A host whose
  link dropped and came back while its server still runs the job is followed again from
  where its stream broke: its ranks, fenced out of the group meanwhile, rejoin on their own.
- A worker host added to the cluster file and brought up while the job runs joins the
  same way, up to MAX. The file is read again every :data:`WATCH_S`.
- Before a joiner's ranks are submitted, its host is prepared as the first hosts were
  (``client/_job_env``): the job's ``--requirements`` layer found or built there, then the
  skew checks. A host that fails them is named and does not join (an added host is not
  tried again; a lost one rejoins at its next `up`, if that fixes it).
- A hung rank (``--hang-timeout-s``) is killed by its host's server as lost, and rejoins.
- A job whose survivors finish every step succeeds: once the chief's host (the store's,
  rank 0's) succeeded, the other hosts have :data:`FINISH_GRACE_S` to report, then are
  stopped, their ranks counted lost (``ranks_lost``): with the store gone they cannot rejoin.
  A worker host whose ranks failed only because a peer or the store went (``peer-lost``) is
  lost too, not the job's failure: the members left decide whether the job goes on. Seen
  across a 15 s partition (issue 52): the survivor finished, and the job ended ``failed`` on
  the cut-off rank's "Broken pipe".
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from distrun.client._links import HostLink, Placement
from distrun.client._stop import stop_everywhere
from distrun.client.cluster import slots_for
from distrun.client._bundle import Bundle
from distrun.client._job_env import PreparedHosts
from distrun.config import ClusterSpec, JobSpec, Role, load_cluster, parse_elastic
from distrun.errors import DistrunError, HostError, HostUnreachable, UsageError
from distrun.protocol import PEER_LOST, Hung

__all__ = ["ElasticHosts", "ElasticJob", "WATCH_S"]

#: How often a running elastic job reads its cluster file again for added worker hosts.
WATCH_S = 2.0
#: After the chief's host finished every step, how long the other hosts have to report theirs
#: (in a job that ends whole they report within a second) before they are stopped as lost.
FINISH_GRACE_S = 10.0


class ElasticJob(Protocol):
    """What :class:`ElasticHosts` reads and calls of the cluster job it serves."""

    cluster: ClusterSpec
    spec: JobSpec | None
    placements: tuple[Placement, ...]
    attempt_id: str
    _links: list[HostLink]
    _results: dict[str, dict[str, Any]]
    _followers: list[threading.Thread]
    _cancelled: threading.Event
    _detaching: bool
    _bundle: Bundle | None
    _prepared: PreparedHosts  # what a joiner needs: the job's layer and its skew checks

    @property
    def replicas(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def _note(self, text: str) -> None: ...
    def _ship(self, link: HostLink, bundle: Bundle) -> bool: ...
    def _submit_to(self, link: HostLink, placement: Placement, attempt_id: str, spec: JobSpec, *,
                   join: bool = False) -> None: ...
    _offsets: dict[str, int]

    def _follow(self, link: HostLink, attempt_id: str, offset: int = 0) -> None: ...


class ElasticHosts:
    """The elastic part of a cluster job: its lost, added and hung hosts."""

    def __init__(self, job: ElasticJob) -> None:
        self._job = job
        self._refused_hosts: set[str] = set()  # added hosts that cannot join (their slots differ)
        self._left_behind: set[str] = set()  # hosts stopped because the job finished without them
        self._prepared_lock = threading.Lock()  # two hosts may join at once: neither's layer is lost

    def result_of(self, link: HostLink, result: dict[str, Any]) -> dict[str, Any]:
        """``link``'s result as the job counts it: a worker host the job finished without, or whose
        ranks failed only because a peer or the store went, is lost with its ranks, not failed."""
        if link is self._job._links[0] or result.get("state") in ("succeeded", "preempted"):
            return result
        failure = result.get("failure") or {}
        if link.label not in self._left_behind and not (result.get("state") == "failed"
                                                        and failure.get("kind") == PEER_LOST):
            return result
        if link.label not in self._left_behind:
            why = str(failure.get("message") or "").splitlines()[0][:200] if failure.get("message") else "peer lost"
            self._job._note(f"[distrun] {link.label}'s ranks lost the job ({why}): it goes on without them (--elastic)")
        return {**result, "state": "lost", "failure": None, "lost_ranks": self._ranks_of(link)}

    def _ranks_of(self, link: HostLink) -> list[int]:
        """The global ranks ``link``'s host runs (``ranks_lost`` names them if it never comes back)."""
        index = self._job._links.index(link)
        if index >= len(self._job.placements):
            return []
        placement = self._job.placements[index]
        return list(range(placement.rank_offset, placement.rank_offset + placement.slots))

    def chief_finished(self, attempt_id: str) -> None:
        """The chief's host succeeded: the job trained every step. Hosts that do not report within
        :data:`FINISH_GRACE_S` are stopped; their ranks (cut off, or started again and waiting
        for a store that is gone) can no longer rejoin."""

        def stop_the_rest() -> None:
            # The whole grace, even where every host has a result now: a lost host's result is
            # taken back when its server answers again with its ranks still running.
            deadline = time.monotonic() + FINISH_GRACE_S
            while not (self._job._cancelled.is_set() or self._job._detaching) and time.monotonic() < deadline:
                time.sleep(0.1)
            behind = [link for link in self._job._links if link.label not in self._job._results]
            if not behind or self._job._cancelled.is_set() or self._job._detaching:
                return
            self._left_behind.update(link.label for link in behind)
            labels = ", ".join(link.label for link in behind)
            self._job._note(f"[distrun] the job finished every step without {labels}: stopping its ranks there, "
                            "counted lost (--elastic)")
            stop_everywhere(behind, attempt_id, "the job finished without this host's ranks (--elastic)")

        threading.Thread(target=stop_the_rest, name="elastic-finish", daemon=True).start()

    def elastic_range(self, text: str) -> dict[str, int]:
        """``--elastic MIN[:MAX]`` counted in worker hosts (torchrun's ``--nnodes``), as replicas (the
        hybrid's ps hosts, placed after them, are not counted)."""
        workers = [p for p in self._job.placements if Role.PS not in p.host.roles]
        slots = sorted({p.slots for p in workers})
        if len(slots) != 1:
            where = self._job.cluster.source or "the cluster"
            raise UsageError(f"--elastic counts worker hosts, so every worker host of {where} needs the same "
                             f"slots: they have {', '.join(map(str, slots))}")
        low, high = parse_elastic(text, len(workers), unit="worker host", scale=slots[0])
        return {"elastic_min": low, "elastic_max": high}

    def lost_host(self, link: HostLink, attempt_id: str, reason: str) -> None:
        """``--elastic``: a worker host (not the chief's, which holds the store) was lost.

        Its ranks died with its server; the others form a new group on their own. When its
        server is back (``distrun up``), its ranks join the running job, healed by a peer.
        """
        self._job._results[link.label] = {"state": "lost", "failure": None, "error": reason,
                                          "lost_ranks": self._ranks_of(link)}
        self._job._note(f"[distrun] lost {link.label} ({reason}): the job goes on without it (--elastic); "
                   "it rejoins once its server is back (`distrun up`)")
        others = [other.label for other in self._job._links if other is not link]

        def job_over() -> bool:
            return self._job._cancelled.is_set() or self._job._detaching or all(label in self._job._results for label in others)

        if not link.wait_for_server(job_over):
            return
        if self._still_running(link, attempt_id):  # its link dropped, not its ranks: they rejoin on their own
            self._job._note(f"[distrun] {link.label} is back, its ranks still in the job: following them again")
            del self._job._results[link.label]
            self._job._follow(link, attempt_id, self._job._offsets.get(link.label, 0))
            return
        placement = self._job.placements[self._job._links.index(link)]
        try:
            self._prepare(link)
            self._job._ship(link, self._job._bundle)
            self._job._submit_to(link, placement, attempt_id, self._job.spec, join=True)
        except HostError as exc:
            self._job._note(f"[distrun] {link.label} is back but could not rejoin: {exc.reason}")
            return
        self._job._note(f"[distrun] {link.label} is back: its ranks join the job")
        del self._job._results[link.label]
        self._job._follow(link, attempt_id)

    def _prepare(self, link: HostLink) -> None:
        """``link``'s host as the job's first hosts were prepared: the job's layer (built where missing,
        leased) on its ranks' ``PYTHONPATH``, and the skew checks passed. HostError if it cannot."""
        assert self._job.spec is not None
        joined = self._job._prepared.join(link, self._job.spec)  # outside the lock: a build takes a while
        if link.label not in joined.env:
            return  # the job has no layer of its own: nothing to record
        with self._prepared_lock:  # merged into the current hosts: another joiner may have been added meanwhile
            now = self._job._prepared
            self._job._prepared = replace(now, env={**now.env, link.label: joined.env[link.label]},
                                          names={**now.names, link.label: joined.names[link.label]})

    def _still_running(self, link: HostLink, attempt_id: str) -> bool:
        """Whether ``link``'s server still runs the attempt (a link that dropped for less than the
        server's lease: its ranks are fenced out of the job's group and rejoin at its next round)."""
        try:
            rows = link.call("jobs").get("jobs", [])
        except HostError:
            return False
        return any(row.get("job") == attempt_id and row.get("state") == "running" for row in rows)

    def lose_hung(self, hang: Hung) -> None:
        """``--elastic``: a stuck rank is treated as lost: its host's server kills it, it rejoins."""
        if hang.rank < 0:
            return
        for link, placement in zip(self._job._links, self._job.placements):
            if placement.rank_offset <= hang.rank < placement.rank_offset + placement.slots:
                try:
                    link.call("lose_rank", job=self._job.attempt_id, rank=hang.rank,
                              why=f"hung for {hang.stalled_s:.0f} s {hang.where}")
                except HostError as exc:
                    self._job._note(f"[distrun] could not stop hung rank {hang.rank} on {link.label}: {exc.reason}")


    def watch_for_hosts(self) -> None:
        """Start the thread that lets added worker hosts join (only while below MAX hosts)."""
        assert self._job.spec is not None
        slots = self._job.placements[0].slots
        if self._job.cluster.source is None or self._job.spec.strategy.elastic_max <= self._job.replicas or slots < 1:
            return
        threading.Thread(target=self._add_hosts, name="elastic-hosts", daemon=True).start()

    def _add_hosts(self) -> None:
        assert self._job.spec is not None and self._job.cluster.source is not None
        while not self.attempt_over():
            time.sleep(WATCH_S)
            if self._job.replicas >= self._job.spec.strategy.elastic_max:
                continue
            try:
                cluster = load_cluster(Path(self._job.cluster.source))
            except DistrunError:
                continue  # being edited: read it at the next turn
            known = {link.label for link in self._job._links} | self._refused_hosts
            for host in cluster.hosts:
                if (Role.WORKER in host.roles and host.label not in known
                        and self._job.replicas < self._job.spec.strategy.elastic_max):
                    self._add_host(cluster, host)

    def _add_host(self, cluster: Any, host: Any) -> None:
        """Submit ``host``'s ranks as joiners once its server answers; follow them like the others."""
        link = HostLink(cluster, host)
        try:
            link.open()
            slots, gpus = slots_for(host, link.info)  # type: ignore[arg-type]
            if slots != self._job.placements[0].slots:
                self._job._note(f"[distrun] {link.label} cannot join: it has {slots} slot(s), the job's hosts "
                           f"{self._job.placements[0].slots} (--elastic counts hosts of the same slots)")
                self._refused_hosts.add(link.label)
                link.close()
                return
            try:
                self._prepare(link)
            except HostUnreachable:
                raise  # its link, not its environment: the next turn tries again
            except HostError as exc:  # its environment: trying again would fail again
                self._job._note(f"[distrun] {link.label} cannot join: {exc.reason}")
                self._refused_hosts.add(link.label)
                link.close()
                return
            placement = Placement(host, slots, self._job.world_size, len(self._job.placements), gpus)
            self._job._ship(link, self._job._bundle)
            before = self._job.placements
            self._job.placements = (*before, placement)  # the submit's world size and TF_CONFIG include it
            try:
                self._job._submit_to(link, placement, self._job.attempt_id, self._job.spec, join=True)  # type: ignore[arg-type]
            except HostError:
                self._job.placements = before
                raise
            self._job._links.append(link)
        except HostError:
            link.close()  # not up yet: the next turn tries again
            return
        self._job._note(f"[distrun] {link.label} was added to {self._job.cluster.source}: its ranks join the job")
        follower = threading.Thread(target=self._job._follow, args=(link, self._job.attempt_id), name=f"follow-{link.label}",
                                    daemon=True)
        self._job._followers.append(follower)
        follower.start()

    def attempt_over(self) -> bool:
        return self._job._cancelled.is_set() or self._job._detaching or len(self._job._results) >= len(self._job._links)
