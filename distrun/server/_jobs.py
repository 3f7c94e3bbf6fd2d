"""Jobs on one worker server: rendezvous sockets, bundles, launchers, event logs.

A job reaches a server in two steps, so no host has to guess a port: the client
asks the server of global rank 0 to ``rendezvous`` (it binds a socket on an
OS-chosen port, or one from the cluster's port range, and keeps it), then
``submit``s to every server with that port. Rank 0's launcher hosts the
TCPStore on the kept socket: there is no probe-then-bind race.

Each job's events go to ``jobs/<id>/events.ndjson`` on the host and to anyone
following it; a follower may start from any offset, so a client can detach and
attach again and see the whole job.

The rendezvous socket binds the host's address on the cluster network, never every
interface; the job's secret comes with ``rendezvous`` and ``submit`` (the control plane)
and reaches the launcher and the ranks, nowhere else (``launch/_store_relay``).

A server lives for weeks: it keeps the newest ``KEEP_FINISHED`` finished jobs in memory,
for ``KEEP_FINISHED_S`` at most. An older job's log stays on disk: ``follow`` (``distrun
logs``, ``attach``) reads it from there, and ``list`` lists it (the newest ``LISTED_FROM_DISK``),
so the history outlives the server too. A rendezvous that no ``submit`` follows within
``RENDEZVOUS_LEASE_S`` (its client died) is closed.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from distrun.config import JobSpec, evaluator_spec
from distrun.launch import LocalLauncher, ProcessState, RunResult, Starter, WorkerSpec
from distrun.protocol.environment import CACHE_DIR_VAR, EVAL_CHECKPOINT_VAR, JOB_SPEC_VAR
from distrun.server._bundle import BundleError, unpack
from distrun.server._job_args import (
    JobError,
    job_id_of,
    port_range_of,
    reason_of,
    secret_of,
    sha_of,
    torchelastic_ids,
)
from distrun.server._job_record import JobRecord, past_jobs
from distrun.server._local_job import LocalJobChannel
from distrun.protocol.wire import Stream, send_frame
from distrun.server._net import address_to_bind, interface_towards

log = logging.getLogger("distrun.server.jobs")

#: How long a follower waits for the next event before it sends a heartbeat.
FOLLOW_HEARTBEAT_S = 1.0
#: A job not started with --detach is cancelled when no client has followed it for this long.
LEASE_S = 10.0
#: A rendezvous socket waits this long for its job's submit, then closes.
RENDEZVOUS_LEASE_S = 60.0
#: A test hook: a file of this name in the server's folder delays this host's cancel (seconds),
#: read only where the server's environment has DR_TEST_HOOKS=1.
KILL_DELAY_HOOK = "test-hook-kill-delay-s"
TEST_HOOKS_VAR = "DR_TEST_HOOKS"
#: Finished jobs kept in memory: at most this many, for at most this long (their logs stay on disk).
KEEP_FINISHED = 64
KEEP_FINISHED_S = 24 * 3600.0


class JobManager:
    def __init__(self, state_dir: Path, starter: Callable[[], Starter | None] = lambda: None) -> None:
        """``starter()``: how to start training processes now (the warm interpreter, or None: cold)."""
        self.state_dir = state_dir
        self._starter = starter
        self.bundles = state_dir / "bundles"
        self.jobs_dir = state_dir / "jobs"
        for folder in (self.bundles, self.jobs_dir):  # the client uploads bundles here over SFTP
            folder.mkdir(mode=0o700, exist_ok=True)
        self._jobs: dict[str, JobRecord] = {}
        self._lock = threading.Lock()

    # -- requests

    def has_bundle(self, args: dict[str, Any]) -> dict[str, Any]:
        sha = sha_of(args)
        return {"present": (self.bundles / sha).is_dir() or (self.bundles / f"{sha}.tar.gz").is_file(),
                "upload_path": str(self.bundles / f"{sha}.tar.gz")}

    def rendezvous(self, args: dict[str, Any]) -> dict[str, Any]:
        """Bind the job's rendezvous socket on this host's cluster address (``address``: this
        host as the cluster file names it; ``interface``: the cluster's, if set)."""
        secret = secret_of(args)
        address = address_to_bind(str(args.get("address") or "127.0.0.1"), args.get("interface"))
        if address is None:
            raise JobError(f"cannot tell this host's address on the cluster network from {args.get('address')!r}; "
                           f"set network.interface in the cluster file")
        job = self._new_job(job_id_of(args))
        job.secret = secret
        low, high = port_range_of(args.get("port_range"))
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for port in ([0] if low is None else range(low, high + 1)):
            try:
                sock.bind((address, port))
                break
            except OSError:
                continue
        else:
            sock.close()
            self._forget(job)
            raise JobError(f"no free port in {low}-{high} on {address} for the rendezvous")
        sock.listen(1024)
        job.listener = sock
        self._expire_rendezvous(job)
        return {"port": int(sock.getsockname()[1]), "address": address}

    def _expire_rendezvous(self, job: JobRecord) -> None:
        """Close a rendezvous no submit followed (its client died between the two calls)."""
        def expire() -> None:
            with job.changed:  # a submit moves the state on under this lock: never both
                if job.state != "pending" or job.listener is None:
                    return
                job.state = "stopped"
                job.listener.close()
            job.record_note(f"no submit within {RENDEZVOUS_LEASE_S:.0f} s of the rendezvous: closing it")
            job.finish("stopped", {"state": "stopped", "failure": None})
            self._forget_old()

        job.rendezvous_lease = threading.Timer(RENDEZVOUS_LEASE_S, expire)
        job.rendezvous_lease.daemon = True
        job.rendezvous_lease.start()

    def submit(self, args: dict[str, Any]) -> dict[str, Any]:
        job_id = job_id_of(args)
        with self._lock:
            job = self._jobs.get(job_id)
        if job is not None and args.get("join") and job.launcher is None and job.result is not None:
            # --elastic: this host's ranks ended here while the client could not reach it (a link down
            # past the lease); they join the running job again as new members, in a new record (the
            # ended one's files set aside: its result.json made every such join "exists").
            self._forget(job)
            job.set_aside()
            job = None
        if job is None:
            job = self._new_job(job_id)
        if job.launcher is not None or job.state != "pending":
            raise JobError(f"job {job_id} was already submitted here")
        secret = secret_of(args)
        if job.secret and not hmac.compare_digest(job.secret, secret):
            raise JobError(f"job {job_id}: the secret differs from the rendezvous's")
        if job.reason is not None:  # cancelled between its rendezvous and this submit (checked again below)
            raise JobError(f"job {job_id} is stopping ({job.reason}); not started here")
        sha = sha_of(args)
        try:
            root = unpack(self.bundles / f"{sha}.tar.gz", sha, self.bundles / sha)
        except FileNotFoundError:
            raise JobError(f"bundle {sha[:12]} was not uploaded") from None
        except BundleError as exc:
            raise JobError(f"bundle {sha[:12]} refused: {exc}") from None
        recipe = (root / str(args["recipe"])).resolve()
        if root.resolve() not in recipe.parents or not recipe.is_file():
            raise JobError(f"recipe {args['recipe']!r} is not in the bundle")
        spec = JobSpec.from_json(str(args["spec"])).replace(recipe=str(recipe))
        if spec.observe.tensorboard_dir:  # --tensorboard: written here, in the job's folder; the client fetches it
            spec = spec.replace(tensorboard_dir=str(job.folder / "tensorboard"))
        if spec.observe.profile_steps:  # --profile: each rank's trace here too; the client fetches every host's
            spec = spec.replace(profile_dir=str(job.folder / "profile"))
        evaluating = None
        if args.get("eval_checkpoint"):  # uploaded by the client into this server's folder
            evaluating = (self.state_dir / str(args["eval_checkpoint"])).resolve()
            if self.state_dir.resolve() not in evaluating.parents or not (evaluating.is_file() or evaluating.is_dir()):
                raise JobError(f"checkpoint {args['eval_checkpoint']!r} is not in this server's folder")
        if evaluating:  # the evaluator role: one process, one device, no process group
            spec = evaluator_spec(spec)
            args = {**args, "local_world_size": 1, "world_size": 1, "rank_offset": 0, "node_rank": 0,
                    "master_addr": "127.0.0.1", "master_port": None}
        master_addr = str(args["master_addr"])
        interface = args.get("interface") or interface_towards(master_addr)
        env = {JOB_SPEC_VAR: spec.to_json(), CACHE_DIR_VAR: str(self.state_dir / "cache"), **spec.extra_env}
        if evaluating:
            env[EVAL_CHECKPOINT_VAR] = str(evaluating)
        if interface:
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
            env.setdefault("NCCL_SOCKET_IFNAME", interface)
        worker = WorkerSpec(
            argv=(sys.executable, "-m", "distrun.runtime"),
            local_world_size=int(args["local_world_size"]),
            world_size=int(args["world_size"]),
            rank_offset=int(args["rank_offset"]),
            node_rank=int(args["node_rank"]),
            master_addr=master_addr,
            master_port=int(args["master_port"]) if args["master_port"] is not None else None,
            env=env,
            cwd=str(root),
            rank_hosts=tuple(str(host) for host in args.get("rank_hosts", ())),
            evaluator_hosts=tuple(str(host) for host in args.get("evaluator_hosts", ())),
            task_type="evaluator" if evaluating else "worker",
            num_ps=0 if evaluating else int(args.get("num_ps", 0)),
            independent_ranks=frozenset(int(rank) for rank in args.get("independent_ranks", ())),
            respawns=int(args.get("respawns", 0)),
            elastic=spec.strategy.elastic,
            join=bool(args.get("join", False)) and spec.strategy.elastic,
            **torchelastic_ids(job_id, int(args.get("respawns", 0))),
            job_secret=secret,
            debug_dir=str(job.folder / "debug"),
        )
        starter = self._starter()
        with job.changed:  # the rendezvous lease's expiry checks the same state under this lock
            if job.reason is not None:
                raise JobError(f"job {job_id} is stopping ({job.reason}); not started here")
            if job.state != "pending":
                raise JobError(f"job {job_id}: its rendezvous closed before the submit (no submit within "
                               f"{RENDEZVOUS_LEASE_S:.0f} s)")
            job.launcher = LocalLauncher(worker, job.record, listener=job.listener, starter=starter)
            job.state = "running"
        if job.rendezvous_lease is not None:  # only now: a submit that failed above leaves the lease running
            job.rendezvous_lease.cancel()
            job.rendezvous_lease = None
        job.detached = bool(args.get("detach", False))
        job.meta = {"recipe": Path(spec.recipe).name, "strategy": spec.strategy.name.value, "layout": spec.layout,
                    "world_size": worker.world_size, "ps_tasks": worker.num_ps,
                    "ranks": [worker.rank_offset, worker.rank_offset + worker.local_world_size - 1]}
        threading.Thread(target=self._run, args=(job,), name=f"job-{job_id}", daemon=True).start()
        self._watch_lease(job)
        return {"job": job_id, "interface": interface, "warm": starter is not None}

    def local_job(self, conn: Stream, request: dict[str, Any]) -> None:
        """A local `distrun train` lists its job here (``server/_local_job``); this connection is
        the job's until its result, which ends the record as a cluster job's result does."""
        args = request.get("args") if isinstance(request.get("args"), dict) else {}
        try:
            world_size, ps_tasks, pid = (_count(args, key) for key in ("world_size", "ps_tasks", "pid"))
            job = self._new_job(job_id_of(args))
        except JobError as exc:
            send_frame(conn, {"id": request.get("id"), "ok": False, "error": {"type": "JobError", "message": str(exc)}})
            return
        channel = LocalJobChannel(conn, job.record, warm=bool(args.get("warm")))
        job.meta = {"recipe": str(args.get("recipe", "?"))[:200], "strategy": str(args.get("strategy", "?"))[:64],
                    "layout": str(args.get("layout", ""))[:200],
                    "world_size": world_size, "ps_tasks": ps_tasks, "ranks": [0, world_size - 1], "pid": pid,
                    "local": True}
        with job.changed:
            job.local, job.launcher, job.state = True, channel, "running"
        try:
            send_frame(conn, {"id": request.get("id"), "ok": True, "result": {"job": job.id}})
            result = channel.serve()
        except OSError:
            result = {"state": "lost", "failure": None, "error": "its `distrun train` went away as it started"}
        job.launcher = None
        if result.get("reason") and job.reason is None:  # stopped by its own Ctrl-C: `distrun jobs` says so
            job.reason = str(result["reason"])
        job.finish(str(result["state"]), result)
        self._forget_old()

    def follow(self, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Events from ``offset`` on, then the result; a heartbeat while nothing happens."""
        job = self._get(args)
        offset = int(args.get("offset", 0))
        until_now = bool(args.get("until_now", False))  # what is there now, then stop (`logs` without --follow)
        with job.changed:
            job.followers += 1
        try:
            while True:
                with job.changed:
                    if offset >= len(job.lines) and job.result is None and not until_now:
                        job.changed.wait(FOLLOW_HEARTBEAT_S)
                    fresh = job.lines[offset:]
                    result = job.result if offset + len(fresh) >= len(job.lines) else None
                if fresh:
                    yield {"events": fresh, "offset": offset + len(fresh)}
                    offset += len(fresh)
                elif result is not None:
                    yield {"result": result}
                    return
                elif until_now:
                    return
                else:
                    yield {"heartbeat": time.time()}  # a dead follower is noticed when this fails
        finally:
            with job.changed:
                job.followers -= 1
                if job.followers == 0:
                    job.unfollowed_since = time.monotonic()
            self._watch_lease(job)

    def _watch_lease(self, job: JobRecord) -> None:
        """Cancel a job nobody follows for LEASE_S, unless it was started with --detach."""
        def expire() -> None:
            with job.changed:
                orphaned = job.followers == 0 and job.state == "running" and not job.detached and not job.local
                left_s = LEASE_S - (time.monotonic() - job.unfollowed_since)
            launcher = job.launcher  # read once: the job's thread clears it when the launcher ends
            if not orphaned or launcher is None:
                return
            if left_s > 0:  # a follower came and went since this timer was set: wait the full lease
                schedule(left_s)
                return
            log.warning("job %s: no client for %.0f s, cancelling (lease expired)", job.id, LEASE_S)
            job.decide_stop("the client went away (lease expired)")
            launcher.stop("the client went away (lease expired)")

        def schedule(delay_s: float) -> None:
            timer = threading.Timer(delay_s, expire)
            timer.daemon = True
            timer.start()

        if not job.detached and not job.local:  # a local job's lease is its own connection
            schedule(LEASE_S)

    def stopping(self, args: dict[str, Any]) -> dict[str, Any]:
        """A cancel's first phase, sent to every host of the job before any is asked to kill:
        a rank that dies from now on (its peer on another host was killed first) is part of
        the stop, so every host ends the job ``stopped``, whichever is killed first."""
        job = self._get(args)
        reason = reason_of(args)
        launcher = job.launcher  # read once: the job's thread clears it when the launcher ends
        if job.decide_stop(reason) and launcher is not None:
            launcher.stopping(reason)  # with no kill behind it, the launcher kills after its own wait
        # No launcher yet (a rendezvous, no submit): the decision is on the record, and refuses the submit.
        return {"job": job.id, "state": job.state}

    def cancel(self, args: dict[str, Any]) -> dict[str, Any]:
        """Kill the job's ranks here (deciding to stop first, if ``stopping`` did not)."""
        job = self._get(args)
        reason = reason_of(args)
        launcher = job.launcher  # read once: the job's thread clears it when the launcher ends
        if launcher is not None:
            delay_s = self._kill_delay_s()
            if delay_s > 0:  # the test hook: this host hears of the cancel late (its peers are killed first)
                job.record_note(f"test hook {KILL_DELAY_HOOK}: this cancel takes effect {delay_s:g} s late")
                timer = threading.Timer(delay_s, _kill, args=(job, launcher, reason))
                timer.daemon = True
                timer.start()
            else:
                _kill(job, launcher, reason)
            return {"job": job.id, "state": job.state}
        with job.changed:
            pending = job.state == "pending" and job.listener is not None
            if pending:
                job.state = "stopped"
                job.listener.close()  # type: ignore[union-attr]
        if pending:
            job.reason = reason
            if job.rendezvous_lease is not None:
                job.rendezvous_lease.cancel()
                job.rendezvous_lease = None
            job.finish("stopped", {"state": "stopped", "failure": None, "reason": reason})
            self._forget_old()
        return {"job": job.id, "state": job.state}

    def _kill_delay_s(self) -> float:
        """The test hook ``KILL_DELAY_HOOK`` in this server's folder, read only where the server's
        environment sets ``TEST_HOOKS_VAR`` (a test lab's cluster file): seconds by which a cancel
        reaches this host late, so a test can force the interleaving where a peer is killed first."""
        if os.environ.get(TEST_HOOKS_VAR) != "1":
            return 0.0
        try:
            return max(0.0, min(60.0, float((self.state_dir / KILL_DELAY_HOOK).read_text())))
        except (OSError, ValueError):
            return 0.0

    def lose_rank(self, args: dict[str, Any]) -> dict[str, Any]:
        """``--elastic``: kill one of this host's ranks as lost (the client saw it hang); it rejoins."""
        job = self._get(args)
        rank = args.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise JobError(f"lose_rank: rank must be a whole number. Received: {rank!r}")
        launcher = job.launcher
        if launcher is not None:
            launcher.lose_rank(rank, str(args.get("why", "lost"))[:200])
        return {"job": job.id}

    def diagnose(self, args: dict[str, Any]) -> dict[str, Any]:
        """``distrun stacks`` and ``--hang-timeout-s``: this host's ranks' stacks (py-spy) and,
        with ``flight_recorder``, the paths of their Flight Recorder dumps ({rank: path}), which
        the client reads. A job that is not running here answers no stack."""
        job = self._get(args)
        launcher = job.launcher  # read once: the job's thread clears it when the launcher ends
        if launcher is None:
            return {"stacks": [], "dumps": {}}
        # A local job's channel asks its own `distrun train`, which reads its ranks.
        return launcher.diagnosis(native=bool(args.get("native")), flight_recorder=bool(args.get("flight_recorder")))

    def artifacts(self, args: dict[str, Any]) -> dict[str, Any]:
        """What the job left here for the client to fetch (``JobRecord.artifacts``)."""
        return self._get(args).artifacts()

    def list(self, _args: dict[str, Any]) -> dict[str, Any]:
        """The jobs kept in memory, then finished ones read from disk (a restarted server's history)."""
        with self._lock:
            kept = [job.summary() for job in self._jobs.values()]
        return {"jobs": [*kept, *past_jobs(self.jobs_dir, {row["job"] for row in kept})]}

    # -- server life

    def running_jobs(self) -> tuple[tuple[str, str], ...]:
        """(id, recipe) of each job running here: `status` names them, and counts them."""
        with self._lock:
            return tuple((job.id, str(job.meta.get("recipe", "?"))) for job in self._jobs.values()
                         if job.state == "running")

    def preempt_all(self) -> None:
        """The allocation warned it will end (Slurm's SIGUSR1): every running job's ranks
        checkpoint at an agreed step and stop (a ``preemptible`` job's; others go on)."""
        with self._lock:
            launchers = [job.launcher for job in self._jobs.values() if job.launcher is not None]
        for launcher in launchers:
            launcher.preempt()

    def stop_all(self, reason: str) -> None:
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            launcher = job.launcher
            if isinstance(launcher, LocalJobChannel):
                launcher.close()  # a local job is its own `distrun train`'s to stop (or the zygote's end)
            elif launcher is not None:
                job.decide_stop(reason)
                launcher.stop(reason)
        for job in jobs:
            with job.changed:
                while job.state == "running":
                    job.changed.wait(0.5)

    # -- helpers

    def _new_job(self, job_id: str) -> JobRecord:
        with self._lock:
            folder = self.jobs_dir / job_id
            if job_id in self._jobs or (folder / "result.json").exists():  # kept, or forgotten but on disk
                raise JobError(f"job {job_id} exists")
            folder.mkdir(parents=True, exist_ok=True)
            job = self._jobs[job_id] = JobRecord(job_id, folder)
        return job

    def _get(self, args: dict[str, Any]) -> JobRecord:
        job_id = job_id_of(args)
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            job = JobRecord.read_back(job_id, self.jobs_dir / job_id)
        if job is None:
            raise JobError(f"no job {job_id} on this server")
        return job

    def _forget(self, job: JobRecord) -> None:
        with self._lock:
            if self._jobs.get(job.id) is job:
                del self._jobs[job.id]

    def _forget_old(self) -> None:
        """Drop finished jobs past KEEP_FINISHED (oldest first) or older than KEEP_FINISHED_S."""
        now = time.monotonic()
        with self._lock:
            finished = sorted((job for job in self._jobs.values() if job.finished_at is not None),
                              key=lambda job: job.finished_at or 0.0)
            excess = len(finished) - KEEP_FINISHED
            for index, job in enumerate(finished):
                if index < excess or now - (job.finished_at or now) > KEEP_FINISHED_S:
                    del self._jobs[job.id]

    def _run(self, job: JobRecord) -> None:
        assert job.launcher is not None
        try:
            result: RunResult = job.launcher.run()
            job.finish(result.state.value, result.record(warm=job.launcher.warm, reason=job.reason))
        except Exception as exc:  # the launcher itself broke: the job fails, the server lives
            log.exception("job %s", job.id)
            job.finish(ProcessState.FAILED.value, {"state": "failed", "failure": None, "error": str(exc)})
        finally:
            job.launcher = None  # its processes, pipes and threads are gone; the job's record stays
            self._forget_old()


def _count(args: dict[str, Any], key: str) -> int:
    """A whole number a request gives (a local job's size, its client's pid), or a JobError."""
    value = args.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise JobError(f"{key}: expected a whole number. Received: {value!r}")
    return value


def _kill(job: JobRecord, launcher: LocalLauncher | LocalJobChannel, reason: str) -> None:
    """Stop the job's ranks here; the record notes why, if ``stopping`` did not (an older client's
    cancel). ``stop`` decides in the launcher itself before it kills."""
    job.decide_stop(reason)
    launcher.stop(reason)
