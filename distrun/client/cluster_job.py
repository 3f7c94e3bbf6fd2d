"""A training job on a cluster: the standalone client of TensorFlow, for PyTorch.

The hosts run worker servers with no model code; this ships the recipe's bundle
to each (only where the server does not have it yet), asks global rank 0's
server for a rendezvous port, submits the job to every training host with its
ranks, and follows each server's event stream. It offers the same surface as
``LocalJob`` (``events()``, ``snapshot()``, ``cancel()``, ``outcome()``), so the
CLI renders a cluster job exactly like a local one.

A failure anywhere cancels the job everywhere: a rank that fails stops its own
host at once (the launcher), and the client, seeing that host's result, cancels
the others, so no rank waits out a collective timeout.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from distrun.client._allocation_watch import AllocationWatch
from distrun.client._bundle import Bundle
from distrun.client._evaluator import EvaluatorRelay
from distrun.client._feed import EventFeed
from distrun.client._elastic_hosts import ElasticHosts
from distrun.client._job_env import JobEnvironment, PreparedHosts, prepare_hosts
from distrun.client._job_state import as_written, blamed_host, host_words, unshipped_hint
from distrun.client._links import HostLink, Placement, holders_of, open_all
from distrun.client._hosts import ps_hosts, training_hosts
from distrun.client._results import fetch_job_results
from distrun.client._server_client import ServerClient
from distrun.client._stop import by_whom, stop_everywhere
from distrun.client._tracker import JobTracker, tracker_settings
from distrun.client.cluster import slots_for
from distrun.client.diagnose import diagnose_hosts
from distrun.client.local import ELASTIC_RESPAWNS, ERROR_BY_KIND, JobOutcome, failure_message, independent_ranks
from distrun.config import ClusterSpec, JobSpec, Role, StrategyName, inspect_recipe
from distrun.errors import HostError, Interrupted, Preempted, TrainingError, UsageError
from distrun.protocol import (
    EVALUATOR_RANK,
    SERVER_RANK,
    Diagnosed,
    Event,
    Hung,
    JobSnapshot,
    JobSummary,
    Output,
    decode_event,
)
from distrun.protocol.secret import new_job_secret

__all__ = ["ClusterJob", "Placement", "training_hosts", "ps_hosts"]

# How long a detaching client waits for its followers to wake before it exits anyway (daemon threads).
DETACH_WAIT_S = 5.0


class ClusterJob:
    """``plan()`` a new job (learns the world size), then ``start(spec, bundle)``; or ``attach()`` to one."""

    def __init__(self, cluster: ClusterSpec, job_id: str, links: list[HostLink],
                 placements: tuple[Placement, ...], *, attached: bool = False,
                 evaluators: list[HostLink] | None = None) -> None:
        self.cluster = cluster
        self._evaluators = evaluators or []
        self._relay: EvaluatorRelay | None = None
        self.job_id = job_id
        self._links = links
        self.placements = placements
        self.attached = attached  # following a job started earlier: Ctrl-C detaches, never cancels
        self._feed: EventFeed | None = None
        self._results: dict[str, dict[str, Any]] = {}
        self._offsets: dict[str, int] = {}  # per host: how far its event stream was read (elastic re-follows)
        self._interrupted = False
        self._detaching = False
        self._cancelled = threading.Event()
        self._followers: list[threading.Thread] = []
        self._supervisor: threading.Thread | None = None
        self._clients: list[ServerClient] = []
        # Guards _clients with _detaching: a follower still connecting when Ctrl-C detaches
        # must see it, or its stream (opened after the others were closed) follows forever.
        self._clients_lock = threading.Lock()
        self._debug_dir: Path | None = None
        self.attempt_id = job_id  # the id servers know the current attempt by: JOB, then JOB-r1, JOB-r2, ...
        self.restarts = 0
        self.max_restarts = 0
        self._user_cancelled = False
        self._saw_checkpoint = False
        self._last_checkpoint: tuple[int, str] | None = None  # (step, path) of the newest checkpoint seen
        self.bundle_sent_to: tuple[str, ...] = ()
        self._port: int | None = None  # the current attempt's rendezvous port
        self._secret = ""  # the current attempt's data-plane secret (hex; protocol/secret)
        self.spec: JobSpec | None = None
        self.elastic = ElasticHosts(self)  # --elastic: lost hosts rejoin, added hosts join, hung ranks go
        self._watch: AllocationWatch | None = None  # a Slurm allocation: its end is named, not just felt
        self._prepared = PreparedHosts()  # per host: the job's own environment layer (client/_job_env)

    @classmethod
    def plan(cls, cluster: ClusterSpec, strategy: StrategyName, *, embeddings_ps: bool = False) -> ClusterJob:
        """``embeddings_ps``: the hybrid's ps hosts run a ps task each, after the strategy's ranks."""
        cluster.require_strategy(strategy.value)
        job_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        links = [HostLink(cluster, host) for host in training_hosts(cluster, strategy, embeddings_ps=embeddings_ps)]
        open_all(links)
        placements, offset = [], 0
        for node_rank, link in enumerate(links):
            assert link.info is not None
            slots, gpus = slots_for(link.host, link.info)
            if strategy is StrategyName.ONE_DEVICE or Role.PS in link.host.roles:
                slots = 1
            placements.append(Placement(link.host, slots, offset, node_rank, gpus))
            offset += slots
        trainers = {link.host for link in links}
        evaluators = [HostLink(cluster, host) for host in cluster.hosts
                      if Role.EVALUATOR in host.roles and host not in trainers][:1]
        try:
            open_all(evaluators)
        except BaseException:
            for link in links:
                link.close()
            raise
        return cls(cluster, job_id, links, tuple(placements), evaluators=evaluators)

    @classmethod
    def attach(cls, cluster: ClusterSpec, job_id: str) -> ClusterJob:
        """Find the hosts that run ``job_id`` (ask every server) and prepare to replay and follow it."""
        links = [HostLink(cluster, host) for host in cluster.hosts]
        open_all(links)
        found = holders_of(links, job_id)
        for link in links:
            if all(link is not holder for holder, _record in found):
                link.close()
        if not found:
            raise UsageError(f"no job {job_id!r} on any host of {cluster.source or 'the local cluster'}; "
                             "`distrun jobs` lists them")
        found.sort(key=lambda pair: pair[1]["ranks"][0])
        placements = tuple(Placement(link.host, meta["ranks"][1] - meta["ranks"][0] + 1, meta["ranks"][0], index, 0)
                           for index, (link, meta) in enumerate(found))
        job = cls(cluster, job_id, [link for link, _ in found], placements, attached=True)
        meta = found[0][1]
        ps_tasks = int(meta.get("ps_tasks", 0))
        job._feed = EventFeed(JobTracker(meta["recipe"], meta["strategy"], meta["world_size"] - ps_tasks, ps_tasks=ps_tasks,
                                         started_at=meta["started_at"], host_of_rank=job.host_of_rank))
        job._start_following()
        return job

    @property
    def world_size(self) -> int:
        return sum(p.slots for p in self.placements)

    @property
    def ps_tasks(self) -> int:
        return sum(p.slots for p in self.placements if Role.PS in p.host.roles)

    @property
    def replicas(self) -> int:
        """Training processes: every rank but the ps tasks."""
        return self.world_size - self.ps_tasks

    @property
    def rank_hosts(self) -> list[str]:
        """The address every global rank runs on, in rank order (rank 0's is the rendezvous address)."""
        return ["127.0.0.1" if self.cluster.local else p.host.address for p in self.placements for _ in range(p.slots)]

    @property
    def gpus_everywhere(self) -> bool:
        """Every training rank has a GPU (ps tasks run on CPUs and do not count)."""
        return all(p.gpus >= p.slots for p in self.placements if Role.PS not in p.host.roles)

    def host_of_rank(self, rank: int) -> str:
        if rank == EVALUATOR_RANK and self._evaluators:
            return f"evaluator on {self._evaluators[0].label}"
        if rank < 0:
            return "server"
        for placement in self.placements:
            if placement.rank_offset <= rank < placement.rank_offset + placement.slots:
                return placement.host.label
        return "?"

    # -- start

    def start(self, spec: JobSpec, bundle: Bundle, *, detach: bool = False, max_restarts: int = 0,
              hang_timeout_s: float | None = None, debug_dir: Path | None = None,
              environment: JobEnvironment | None = None) -> None:
        """Check the hosts' environments (``environment``: the job's own packages, ``--allow-skew``) before any
        rank runs, ship the bundle where it is missing, rendezvous, submit everywhere; follow unless ``detach``.

        ``max_restarts``: when a rank fails, restart every rank (from the newest
        checkpoint, if one was written) up to this many times. The client drives
        restarts, so they need a followed job, not ``detach``.
        ``debug_dir``: where a hang's Flight Recorder dumps come home (None: only stacks are read).
        """
        if detach and max_restarts:
            raise UsageError("--max-restarts needs the client attached (restarts are driven by it); drop --detach")
        self.spec = spec
        self.max_restarts = max_restarts
        self._bundle = bundle
        self._detach = detach
        self._debug_dir = debug_dir
        self._feed = EventFeed(JobTracker(spec.recipe, spec.strategy.name.value, spec.trainer_ranks,
                                          started_at=time.time(), host_of_rank=self.host_of_rank,
                                          ps_tasks=spec.ps.tasks, **tracker_settings(spec)),
                               hang_timeout_s=hang_timeout_s, on_hang=self._on_hang)
        everyone = self._links + self._evaluators
        self._prepared = prepare_hosts(everyone, self.cluster, spec, bundle.files, environment, self.job_id)
        with ThreadPoolExecutor(max_workers=min(32, len(everyone))) as pool:
            sent = list(pool.map(lambda link: self._ship(link, bundle), everyone))
        self.bundle_sent_to = tuple(link.label for link, was_sent in zip(everyone, sent) if was_sent)
        if self._evaluators and spec.checkpoint.dir and "eval_data" in inspect_recipe(spec.recipe).functions:
            self._relay = EvaluatorRelay(self.job_id, self._evaluators[0], bundle,
                                         self._prepared.spec_for(self._evaluators[0].label, spec), self._events,
                                         self.rank_hosts)
        self._submit(self.job_id, spec)
        if not detach:
            self._start_following()
            if spec.strategy.elastic:
                self.elastic.watch_for_hosts()

    def _on_hang(self, hang: Hung) -> None:
        """Every host's stacks and Flight Recorders first; then ``--elastic`` loses the stuck host."""
        assert self._feed is not None
        self._feed.put(self.diagnose("hang", dest=self._debug_dir))
        if self.spec is not None and self.spec.strategy.elastic:
            self.elastic.lose_hung(hang)

    def diagnose(self, reason: str = "asked", *, native: bool = False, dest: Path | None = None) -> Diagnosed:
        """Every running rank's stack, from every host; with ``dest``, the Flight Recorder dumps too."""
        return diagnose_hosts(self._links, self.attempt_id, reason, native=native, dest=dest)

    def _submit(self, attempt_id: str, spec: JobSpec) -> None:
        rank0 = self._links[0]
        port_range = list(self.cluster.network.port_range) if self.cluster.network.port_range else None
        self._secret = new_job_secret()  # each attempt its own: a restarted job's old ranks cannot reach the new
        self._port = rank0.call("rendezvous", job=attempt_id, port_range=port_range, address=self.rank_hosts[0],
                                interface=self.cluster.network.interface, secret=self._secret)["port"]
        for link, placement in zip(self._links, self.placements):
            self._submit_to(link, placement, attempt_id, spec)
        self.attempt_id = attempt_id

    def _submit_to(self, link: HostLink, placement: Placement, attempt_id: str, spec: JobSpec, *,
                   join: bool = False) -> None:
        """``join``: ``--elastic``, a host that was lost and is back: its ranks join the running job."""
        spec = self._prepared.spec_for(link.label, spec)  # the job's own layer on this host's PYTHONPATH
        link.call("submit", job=attempt_id, bundle=self._bundle.sha256, recipe=self._bundle.recipe,
                  spec=spec.to_json(), local_world_size=placement.slots, world_size=self.world_size,
                  rank_offset=placement.rank_offset, node_rank=placement.node_rank,
                  master_addr=self.rank_hosts[0], master_port=self._port, interface=self.cluster.network.interface,
                  rank_hosts=self.rank_hosts, detach=self._detach,
                  evaluator_hosts=[link.host.address for link in self._evaluators],
                  num_ps=spec.ps.tasks, independent_ranks=sorted(independent_ranks(spec)),
                  respawns=ELASTIC_RESPAWNS if spec.strategy.elastic else self.max_restarts, join=join,
                  secret=self._secret)

    def _start_following(self) -> None:
        if self.cluster.allocation is not None:
            self._watch = AllocationWatch(self.cluster, self._allocation_ended,
                                          report=lambda line: self._note(f"[distrun] {line}")).start()
        self._supervisor = threading.Thread(target=self._supervise, name="job-supervisor", daemon=True)
        self._supervisor.start()

    def _follow_attempt(self) -> None:
        self._followers = [threading.Thread(target=self._follow, args=(link, self.attempt_id),
                                            name=f"follow-{link.label}", daemon=True) for link in self._links]
        for thread in self._followers:
            thread.start()
        for thread in self._followers:
            thread.join()

    def _supervise(self) -> None:
        """Follow each attempt to its end; restart every rank after a failure while restarts are left."""
        try:
            self._follow_attempt()
            while self._restart_wanted():
                self.restarts += 1
                # The root cause, as outcome() would name it: not whichever host's result came first
                # (a rejoining rank that lost its store may end before the rank that failed on its own).
                root = blamed_host(self._results.items())
                failure = root[1] if root is not None else None
                how = "from the newest checkpoint" if self._saw_checkpoint else "from the start (no checkpoint yet)"
                why = f" after rank {failure.rank}: {failure.message}" if failure else ""
                self._events.put(Output(rank=failure.rank if failure else 0, time=time.time(), stream="stderr",
                                        line=f"[distrun] restarting every rank ({self.restarts}/{self.max_restarts}) "
                                             f"{how}{why}"))
                self._results = {}
                self._cancelled.clear()
                assert self.spec is not None  # start() set it before the first attempt
                spec = self.spec.replace(resume=self._saw_checkpoint)
                try:
                    self._submit(f"{self.job_id}-r{self.restarts}", spec)
                except HostError as exc:
                    self._results = {exc.host: {"state": "failed", "failure": None, "error": exc.reason}}
                    break
                self._follow_attempt()
        finally:
            self._last_look_at_allocation()
            if self._relay is not None:  # the last checkpoint's evaluation, unless the job was stopped
                states = [result.get("state") for result in self._results.values()]
                self._relay.finish(wait=bool(states) and all(state == "succeeded" for state in states))
            self._events.end()

    def _allocation_ended(self, reason: str) -> None:
        self._note(f"[distrun] {reason}")
        self._cancel_attempt(reason)

    def _last_look_at_allocation(self) -> None:
        """The watch asks once a second; a job that just lost its hosts asks once more before blaming a rank."""
        if self._watch is None:
            return
        self._watch.stop()
        states = [result.get("state") for result in self._results.values()]
        if self._watch.reason is None and not (self._succeeded(states) and len(states) == len(self._links)):
            reason = self._watch.check()
            if reason is not None:
                self._note(f"[distrun] {reason}")

    def _restart_wanted(self) -> bool:
        if self._user_cancelled or self._detaching or self.restarts >= self.max_restarts:
            return False
        if self._watch is not None and self._watch.reason is not None:
            return False  # the hosts are gone: nothing to restart on
        if any(result.get("state") == "preempted" for result in self._results.values()):
            return False  # the allocation is about to end: a restart would be killed with it
        states = [result.get("state") for result in self._results.values()]
        return len(states) == len(self._links) and not self._succeeded(states)

    def _succeeded(self, states: list[Any]) -> bool:
        """Every host succeeded; under ``--elastic`` a host lost for good may be missing (the others went on)."""
        ok = {"succeeded", "lost"} if self.spec is not None and self.spec.strategy.elastic else {"succeeded"}
        return bool(states) and all(state in ok for state in states) and "succeeded" in states

    def _ship(self, link: HostLink, bundle: Bundle) -> bool:
        if link.call("has_bundle", bundle=bundle.sha256)["present"]:
            return False
        link.remote.write_file(f"{link.state_dir}/bundles/{bundle.sha256}.tar.gz", bundle.data)
        return True

    def _follow(self, link: HostLink, attempt_id: str, offset: int = 0) -> None:
        """Read ``link``'s events of the attempt from ``offset`` on (an elastic host back from a lost
        link is followed again from where its stream broke)."""
        try:
            with link.client() as client:
                with self._clients_lock:
                    self._clients.append(client)
                    if self._detaching:
                        return
                for item in client.stream("follow", job=attempt_id, offset=offset):
                    if "offset" in item:
                        self._offsets[link.label] = int(item["offset"])
                    for raw in item.get("events", ()):
                        if raw.get("type") == "checkpoint":
                            self._saw_checkpoint = True
                            self._last_checkpoint = (int(raw["step"]), str(raw["path"]))
                            if self._relay is not None:
                                self._relay.offer(link, str(raw["path"]), int(raw["step"]))
                        self._events.put(decode_event(json.dumps(raw)))
                    if "result" in item:
                        elastic = self.spec is not None and self.spec.strategy.elastic
                        result = self.elastic.result_of(link, item["result"]) if elastic else item["result"]
                        self._results[link.label] = result
                        if result.get("state") not in ("succeeded", "preempted", "lost") and not self._detaching:
                            self._cancel_attempt(f"{link.label} ended: {result.get('state')}")
                        elif elastic and link is self._links[0] and result.get("state") == "succeeded":
                            self.elastic.chief_finished(attempt_id)
        except HostError as exc:
            if self._detaching:
                return
            if self.spec is not None and self.spec.strategy.elastic:
                if link is not self._links[0]:
                    self.elastic.lost_host(link, attempt_id, exc.reason)
                    return
                self._note(f"[distrun] lost the chief host {link.label} ({exc.reason}): it holds the job's store "
                           "and rank 0, so an elastic job cannot go on without it; --max-restarts restarts every "
                           "rank from the newest checkpoint")
            self._results[link.label] = {"state": "failed", "failure": None, "error": exc.reason}
            self._cancel_attempt(f"lost {link.label}", unreachable=link)

    def _note(self, line: str) -> None:
        self._events.put(Output(rank=SERVER_RANK, time=time.time(), stream="stderr", line=line))

    # -- the LocalJob surface

    @property
    def _events(self) -> EventFeed:
        if self._feed is None:
            raise RuntimeError("the job has not started")
        return self._feed

    def events(self, poll_s: float = 0.25) -> Iterator[Event | None]:
        return self._events.events(poll_s)

    def snapshot(self) -> JobSnapshot:
        return self._events.snapshot()

    def summary(self, status: str, error: str | None = None) -> JobSummary:
        results = list(self._results.values())  # a follower outliving a detach may still add one
        warm = bool(results) and all(result.get("warm") for result in results)
        lost = sorted(int(rank) for result in results for rank in result.get("lost_ranks") or ())
        summary = self._events.summary(status, error)  # its reason: a callback's that stopped the run early
        return dataclasses.replace(summary, restarts=self.restarts, warm=warm, ranks_lost=lost,
                                   reason=self.stop_reason if status == "interrupted" else summary.reason)

    @property
    def stop_reason(self) -> str | None:
        """Why the job was stopped, as its hosts recorded it (None: it was not stopped)."""
        return next((str(result["reason"]) for result in list(self._results.values())
                     if result.get("state") == "stopped" and result.get("reason")), None)

    def cancel(self, reason: str = "cancelled", *, interrupted: bool = False) -> None:
        """Stop the job on every host, for good; an attached client (``attach``) only stops following."""
        self._interrupted = self._interrupted or interrupted
        if self.attached and interrupted:
            self._stop_following()
            return
        self._user_cancelled = True
        self._cancel_attempt(by_whom("interrupted") if interrupted else reason)

    def _stop_following(self) -> None:
        """Detach from an attached job; the job goes on. The view ends first, not once every follower
        has woken from its closed stream: a detach must never wait on a host (a CI run's attach once
        outlived its Ctrl-C by 30 s)."""
        with self._clients_lock:
            self._detaching = True
            clients = list(self._clients)
        if self._feed is not None:
            self._feed.end()
        for client in clients:
            client.close()

    def _cancel_attempt(self, reason: str, *, unreachable: HostLink | None = None) -> None:
        """Stop the attempt on every host as one decision; a host already gone is its follower's to report.
        ``unreachable``: the host whose loss is the reason, not asked (it would use up each phase's wait)."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        stop_everywhere([link for link in self._links if link is not unreachable], self.attempt_id, reason)

    def outcome(self) -> JobOutcome:
        if self._supervisor is not None:
            self._supervisor.join(DETACH_WAIT_S if self._detaching else None)
        if self._detaching:
            raise Interrupted(f"detached from job {self.job_id}; it goes on (`distrun cancel {self.job_id}` stops it)")
        if self._watch is not None and self._watch.reason is not None and not self._interrupted:
            raise HostError("slurm", self._watch.reason)  # what ended the job, before what it did to the ranks
        states = {label: result.get("state") for label, result in self._results.items()}
        if self._succeeded(list(states.values())) and len(states) == len(self._links):
            return JobOutcome(self.summary("succeeded"), None)
        if "preempted" in states.values() and all(s in ("preempted", "stopped") for s in states.values()):
            step, where = self._last_checkpoint or (0, "")
            raise Preempted(f"the allocation warned that it will end: every rank checkpointed at step {step} "
                            f"({where}) and stopped; after `distrun up`, the same command with --resume goes on")
        root = blamed_host(self._results.items())
        if self._interrupted or root is None and all(s == "stopped" for s in states.values()):
            why = f" ({self.stop_reason})" if self.stop_reason and not self._interrupted else ""
            raise Interrupted(f"interrupted: stopped {self.world_size} replica(s) on {len(self._links)} host(s)"
                              f"{why}")
        if root is None:
            errors = "; ".join(f"{label}: {r.get('error') or r.get('state')}" for label, r in self._results.items())
            raise TrainingError(f"job {self.job_id} failed: {errors or 'no host reported a result'}")
        label, failure = root
        if failure is None:  # the host itself was lost (its server, or the link to it): a host error
            raise HostError(label, host_words(self._results[label]))
        message = f"{label}: {failure_message(as_written(failure))}"
        message += unshipped_hint(failure.message, self.spec.recipe if self.spec else None)
        error_class = ERROR_BY_KIND.get(failure.kind)
        if error_class is not None:
            raise error_class(message, detail=failure.traceback)
        raise TrainingError(message, rank=failure.rank, detail=failure.traceback,
                            stderr_tail=self._events.stderr_tail(failure.rank))

    def fetch_results(self, dest: Path, summary: JobSummary) -> dict[str, Any]:
        """Copy the newest checkpoint (from rank 0's host), the summary, the ``--tensorboard`` files
        and every host's ``--profile`` traces home (``client/_results``)."""
        if self._watch is not None and self._watch.reason is not None:
            raise HostError("slurm", "the allocation ended, and the checkpoint with it unless the folder is shared")
        attempts = [self.job_id] + [f"{self.job_id}-r{n}" for n in range(1, self.restarts + 1)]
        return fetch_job_results(self._links, self.job_id, attempts, self.attempt_id, self.spec, dest, summary)

    def close(self) -> None:
        for link in self._links + self._evaluators:
            link.close()

    def __enter__(self) -> ClusterJob:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._supervisor is not None and self._supervisor.is_alive() and not self._detaching:
            if self.attached:  # it only ever detaches: the job is not its to stop
                self._stop_following()
                self._supervisor.join(DETACH_WAIT_S)
            else:
                self.cancel("client exiting")
                self._supervisor.join(30)
        self.close()
