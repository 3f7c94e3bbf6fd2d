"""A cluster job's hosts under ``--elastic``: lost hosts rejoin, added hosts join, hung ranks go.

``ClusterJob`` takes these from :class:`ElasticHosts`. They are the client's part of
elastic training (docs/elastic.md); the ranks' part is ``strategies/_elastic``.

- ``--elastic MIN[:MAX]`` counts worker hosts, as torchrun's ``--nnodes`` does.
- A lost worker host (its server killed, the host down): the others go on; once its
  server answers again (``distrun up``), its ranks are submitted as joiners.
- A worker host added to the cluster file and brought up while the job runs joins the
  same way, up to MAX. The file is read again every :data:`WATCH_S`.
- A hung rank (``--hang-timeout-s``) is killed by its host's server as lost, and rejoins.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distrun.client._links import HostLink, Placement
from distrun.client.cluster import slots_for
from distrun.config import Role, load_cluster, parse_elastic
from distrun.errors import DistrunError, HostError, UsageError
from distrun.protocol import Hung

if TYPE_CHECKING:
    from distrun.client.cluster_job import ClusterJob

__all__ = ["ElasticHosts", "WATCH_S"]

#: How often a running elastic job reads its cluster file again for added worker hosts.
WATCH_S = 2.0


class ElasticHosts:
    """The elastic part of :class:`~distrun.client.cluster_job.ClusterJob` (a mixin: it uses its state)."""

    def elastic_range(self: ClusterJob, text: str) -> dict[str, int]:
        """``--elastic MIN[:MAX]`` counted in worker hosts (torchrun's ``--nnodes``), as replicas."""
        slots = sorted({p.slots for p in self.placements})
        if len(slots) != 1:
            where = self.cluster.source or "the cluster"
            raise UsageError(f"--elastic counts worker hosts, so every worker host of {where} needs the same "
                             f"slots: they have {', '.join(map(str, slots))}")
        low, high = parse_elastic(text, len(self.placements), unit="worker host", scale=slots[0])
        return {"elastic_min": low, "elastic_max": high}

    def _lost_host(self: ClusterJob, link: HostLink, attempt_id: str, reason: str) -> None:
        """``--elastic``: a worker host (not the chief's, which holds the store) was lost.

        Its ranks died with its server; the others form a new group on their own. When its
        server is back (``distrun up``), its ranks join the running job, healed by a peer.
        """
        self._results[link.label] = {"state": "lost", "failure": None, "error": reason}
        self._note(f"[distrun] lost {link.label} ({reason}): the job goes on without it (--elastic); "
                   "it rejoins once its server is back (`distrun up`)")
        others = [other.label for other in self._links if other is not link]

        def job_over() -> bool:
            return self._cancelled.is_set() or self._detaching or all(label in self._results for label in others)

        if not link.wait_for_server(job_over):
            return
        placement = self.placements[self._links.index(link)]
        try:
            self._ship(link, self._bundle)
            self._submit_to(link, placement, attempt_id, self.spec, join=True)
        except HostError as exc:
            self._note(f"[distrun] {link.label} is back but could not rejoin: {exc.reason}")
            return
        self._note(f"[distrun] {link.label} is back: its ranks join the job")
        del self._results[link.label]
        self._follow(link, attempt_id)

    def _lose_hung(self: ClusterJob, hang: Hung) -> None:
        """``--elastic``: a stuck rank is treated as lost: its host's server kills it, it rejoins."""
        if hang.rank < 0:
            return
        for link, placement in zip(self._links, self.placements):
            if placement.rank_offset <= hang.rank < placement.rank_offset + placement.slots:
                try:
                    link.call("lose_rank", job=self.attempt_id, rank=hang.rank,
                              why=f"hung for {hang.stalled_s:.0f} s {hang.where}")
                except HostError as exc:
                    self._note(f"[distrun] could not stop hung rank {hang.rank} on {link.label}: {exc.reason}")


    def _watch_for_hosts(self: ClusterJob) -> None:
        """Start the thread that lets added worker hosts join (only while below MAX hosts)."""
        assert self.spec is not None
        slots = self.placements[0].slots
        if self.cluster.source is None or self.spec.elastic_max <= self.replicas or slots < 1:
            return
        threading.Thread(target=self._add_hosts, name="elastic-hosts", daemon=True).start()

    def _add_hosts(self: ClusterJob) -> None:
        assert self.spec is not None and self.cluster.source is not None
        while not self._attempt_over():
            time.sleep(WATCH_S)
            if self.replicas >= self.spec.elastic_max:
                continue
            try:
                cluster = load_cluster(Path(self.cluster.source))
            except DistrunError:
                continue  # being edited: read it at the next turn
            known = {link.label for link in self._links} | self._refused_hosts
            for host in cluster.hosts:
                if Role.WORKER in host.roles and host.label not in known and self.replicas < self.spec.elastic_max:
                    self._add_host(cluster, host)

    def _add_host(self: ClusterJob, cluster: Any, host: Any) -> None:
        """Submit ``host``'s ranks as joiners once its server answers; follow them like the others."""
        link = HostLink(cluster, host)
        try:
            link.open()
            slots, gpus = slots_for(host, link.info)  # type: ignore[arg-type]
            if slots != self.placements[0].slots:
                self._note(f"[distrun] {link.label} cannot join: it has {slots} slot(s), the job's hosts "
                           f"{self.placements[0].slots} (--elastic counts hosts of the same slots)")
                self._refused_hosts.add(link.label)
                link.close()
                return
            placement = Placement(host, slots, self.world_size, len(self.placements), gpus)
            self._ship(link, self._bundle)
            before = self.placements
            self.placements = (*before, placement)  # the submit's world size and TF_CONFIG include it
            try:
                self._submit_to(link, placement, self.attempt_id, self.spec, join=True)  # type: ignore[arg-type]
            except HostError:
                self.placements = before
                raise
            self._links.append(link)
        except HostError:
            link.close()  # not up yet: the next turn tries again
            return
        self._note(f"[distrun] {link.label} was added to {self.cluster.source}: its ranks join the job")
        follower = threading.Thread(target=self._follow, args=(link, self.attempt_id), name=f"follow-{link.label}",
                                    daemon=True)
        self._followers.append(follower)
        follower.start()

    def _attempt_over(self: ClusterJob) -> bool:
        return self._cancelled.is_set() or self._detaching or len(self._results) >= len(self._links)
