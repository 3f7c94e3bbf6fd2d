"""Starting and supervising the training processes of one machine.

The client runs this for local jobs, the worker server for its host's ranks. It never
imports torch: it starts processes, turns their pipes into events, and tears everything
down when any rank fails or a stop is requested.

Guarantees (each held by a test):

* every process runs in its own session, so the launcher, not the terminal,
  decides when it stops, and stopping kills its whole process group (DataLoader
  workers included): SIGTERM, then SIGKILL after ``stop_grace_s``;
* a rank that exits non-zero stops all others at once; no rank is left waiting
  on a collective for the backend's 30-minute timeout (except an
  ``independent_ranks`` rank: a parameter-server worker fails alone, and is
  started again while ``respawns`` last);
* training processes ask the kernel to kill them if the launcher dies
  (PR_SET_PDEATHSIG, set by the runtime bootstrap), so even a SIGKILLed
  launcher leaves no orphans;
* the first failure is the root cause: a primary failure beats a ``peer-lost``
  one, and among equals the earliest wins;
* ``preempt()`` (a scheduler's warning that the job will end) hands SIGUSR1 to each rank
  alone, not its group (a DataLoader worker would die of it); ranks that then exit with
  ``PREEMPTED_EXIT_CODE`` (checkpoint written) stop no one, and the run ends ``preempted``.
  Exit 75 from a rank nobody told is a failure like any other;
* ``stacks()`` and ``dump_flight_recorder()`` look inside running ranks without stopping
  them (``distrun stacks``, ``--hang-timeout-s``): py-spy reads each rank's stack, and a
  byte on each rank's diagnose pipe asks it for its Flight Recorder (``runtime/_flight_recorder``);
* ``--elastic``: an agent process beside the ranks hosts the rendezvous store, which
  outlives every rank (``launch/_agent``). A rank that dies without saying why (a
  signal) stops no one: the agent marks it lost, the others form a new group, and it is
  started again as a joiner while ``respawns`` last; so is a rank stopped by a signal
  (SIGSTOP) for ``STOPPED_LOST_S`` (``launch/_stopped``), which would never come back on its own;
* a rank the kernel's OOM killer ends is named as such (``launch/_oom``);
* a job of this machine alone (``private_network``) has a loopback of its own (``launch/_netns``).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from distrun.launch._agent import ElasticAgent
from distrun.launch._chief_store import ChiefStore
from distrun.launch._diagnose import RankDiagnosis
from distrun.launch._env import process_env
from distrun.launch._lines import LineBuffer
from distrun.launch._exits import exit_failure, ps_task_lost, ps_task_of
from distrun.launch._oom import OomWatch
from distrun.launch._proc import Proc as _Proc
from distrun.launch._netns import JoiningStarter, PrivateNetwork, store_socket
from distrun.launch._starter import PopenStarter, Starter, ZygoteUnavailable
from distrun.launch._stop import DEFAULT_KILL_AFTER_S, StopDecision
from distrun.launch._stopped import StoppedWatch
from distrun.launch._store_relay import StoreRelay
from distrun.launch.api import ProcessState, RunResult, WorkerSpec
from distrun.protocol import (
    OOM_KILLED,
    SERVER_RANK,
    Event,
    EventDecodeError,
    Exited,
    Failed,
    Output,
    Step,
    decode_event,
)
from distrun.protocol.diagnosis import RankStack
from distrun.protocol.environment import (
    DIAGNOSE_FD_VAR,
    ELASTIC_JOINER_VAR,
    EVENT_FD_VAR,
    INCARNATION_VAR,
    PARENT_PID_VAR,
    PREEMPTED_EXIT_CODE,
    STORE_FD_VAR,
    STORE_ROLE_VAR,
)
from distrun.protocol.secret import new_job_secret

__all__ = ["LocalLauncher", "EventSink"]

EventSink = Callable[[Event], None]

_TICK_S = 0.05
_DRAIN_S = 2.0


class LocalLauncher:
    """Starts ``spec.local_world_size`` processes and supervises them to the end. ``run()`` blocks
    until every process has exited; ``stop()``, from any thread, makes it return soon."""

    def __init__(self, spec: WorkerSpec, sink: EventSink, *, listener: socket.socket | None = None,
                 starter: Starter | None = None) -> None:
        """``listener``: a rendezvous socket bound beforehand on the cluster address (a worker
        server binds it when the job is planned, so hosts can be told the port before any rank
        starts). The store's front answers there (``launch/_store_relay``); global rank 0 hosts
        the store itself on a loopback socket this launcher binds.
        ``starter``: how processes start (default: a fresh interpreter each; a worker
        server passes its warm interpreter, and a cold start is the fallback)."""
        self._spec = spec
        self._listener = listener
        self._starter: Starter = starter or PopenStarter()
        self._sink = sink
        self._procs: list[_Proc] = []
        self._stop = StopDecision()  # cancel: every host decides to stop before any rank is killed
        self._selector = selectors.DefaultSelector()
        self._failures: list[Failed] = []
        self._respawned: dict[int, int] = {}  # rank -> times started again
        self._port = 0  # the job's rendezvous port (TF_CONFIG)
        self._store_port = 0  # where this host's ranks reach the store, on loopback
        self._secret = bytes.fromhex(spec.job_secret) if spec.job_secret else bytes.fromhex(new_job_secret())
        self._relay: StoreRelay | None = None  # other hosts: this host's ranks go out here
        self._started = False
        self._cold_starts = 0  # processes started as a fresh interpreter (not forked warm)
        self._network: PrivateNetwork | None = None  # spec.private_network: the job's own (launch/_netns)
        self._chief_store: ChiefStore | None = None  # a cluster job's chief: the store's own network
        self._agent: ElasticAgent | None = None  # --elastic: hosts the store (or is its client), tells of deaths
        self._lose: list[tuple[int, str]] = []  # --elastic: (rank, why) to kill as lost, from any thread
        self._preempt_requested = threading.Event()
        self._preempt_sent = False
        self._preempted: set[int] = set()  # ranks that checkpointed and stopped to be requeued
        self._diagnose = RankDiagnosis(self._running, spec.debug_dir)
        self._oom = OomWatch()  # names the kernel's OOM killer when a rank dies of a SIGKILL not ours
        self._stopped = StoppedWatch()  # --elastic: a rank stopped by a signal is lost (launch/_stopped)

    # -- public ---------------------------------------------------------------

    def run(self) -> RunResult:
        self._start()
        try:
            state = self._supervise()
        finally:
            self._kill_all(signal.SIGKILL)
            self._reap_all()
            self._stop_agent()
            self._close_store_access()
            self._drain_pipes(deadline=time.monotonic() + _DRAIN_S)
            self._selector.close()
            self._diagnose.close_all(self._procs)
        if state is ProcessState.STOPPED and self._stop.root_cause(self._failures) is not None:
            # A rank's own failure, stamped before the stop was decided but read after it: the job's.
            state = ProcessState.FAILED
        return RunResult(
            state=state,
            returncodes={p.rank: (p.returncode if p.returncode is not None else -signal.SIGKILL) for p in self._procs},
            # Also when stopped: a rank that died on its own just before a stop request
            # (a peer host's failure reached us first) is still the root cause.
            failure=self._stop.root_cause(self._failures),
        )

    def stop(self, reason: str = "stop requested") -> None:
        """Kill every rank now (SIGTERM, then SIGKILL after ``stop_grace_s``); the run ends ``stopped``."""
        self._stop.request(reason)

    def stopping(self, reason: str, *, kill_after_s: float = DEFAULT_KILL_AFTER_S) -> None:
        """The job is stopping (a cancel's first phase, sent to every host before any is killed):
        a rank that dies from now on is part of the stop, and the run ends ``stopped``. With no
        ``stop()`` behind it, the ranks are killed ``kill_after_s`` from now all the same."""
        self._stop.decide(reason, kill_after_s=kill_after_s)

    @property
    def stop_reason(self) -> str | None:
        """Why the job was stopped (or is stopping); None if nobody asked."""
        return self._stop.reason

    def preempt(self) -> None:
        """The job will end soon (Slurm's SIGUSR1): ranks checkpoint at an agreed step and stop.
        Safe from a signal handler: the supervising loop does the signalling."""
        self._preempt_requested.set()

    def lose_rank(self, rank: int, why: str) -> None:
        """``--elastic``: kill ``rank`` as lost (a hung rank): the others go on, and it is started again.

        Thread-safe; the supervising loop does the killing.
        """
        self._lose.append((rank, why))

    @property
    def warm(self) -> bool:
        """Every process so far was forked from a warm interpreter (none started cold)."""
        return bool(self._procs) and self._cold_starts == 0

    @property
    def pids(self) -> list[int]:
        return [p.popen.pid for p in self._procs]

    def stacks(self, *, native: bool = False, host: str = "") -> list[RankStack]:
        """Every running rank's main-thread stack now (py-spy; ``launch/_diagnose``). Thread-safe."""
        return self._diagnose.stacks(native=native, host=host)

    def diagnosis(self, *, native: bool = False, flight_recorder: bool = False, host: str = "") -> dict[str, Any]:
        """``distrun stacks``' answer for this launcher's ranks, in the wire's shape (``launch/_diagnose``)."""
        return self._diagnose.answer(native=native, flight_recorder=flight_recorder, host=host)

    def dump_flight_recorder(self, timeout_s: float = 10.0) -> dict[int, str]:
        """Every running rank's Flight Recorder, {rank: the dump's path} (``launch/_diagnose``). Thread-safe."""
        return self._diagnose.dump_flight_recorder(timeout_s)

    def _running(self) -> list[_Proc]:
        return [p for p in list(self._procs) if p.returncode is None]

    # -- start ----------------------------------------------------------------

    def _start(self) -> None:
        if self._started:
            raise RuntimeError("a LocalLauncher runs once")
        self._started = True
        spec = self._spec
        if spec.debug_dir:
            os.makedirs(spec.debug_dir, mode=0o700, exist_ok=True)  # NCCL's own dump on a timeout goes here too
        store_listener: socket.socket | None = None  # the store's own socket, on loopback
        if self._listener is not None:  # a cluster job's chief: the store in a network of its own, its front
            self._chief_store = ChiefStore(self._note_job, front=(self._listener, self._secret))
            store_listener = self._chief_store.listener  # this host's ranks: the relay on the store's port number
            self._store_port, self._port = self._chief_store.port, int(self._listener.getsockname()[1])
        elif spec.master_port is None:  # a local job: every process it starts joins its network
            store_listener, self._network = store_socket(spec.private_network, self._note_job)
            if self._network is not None:
                self._starter = JoiningStarter(self._starter, self._network)
            self._store_port = self._port = int(store_listener.getsockname()[1])
        else:
            self._relay = StoreRelay.to_front((spec.master_addr, spec.master_port), self._secret, self._note_job)
            self._store_port, self._port = self._relay.port, spec.master_port
        for_rank0 = store_listener  # who hosts the store on it: rank 0, or (elastic) the agent
        try:
            if spec.elastic:
                self._start_agent(store_listener)
                for_rank0 = None
            for local_rank in range(spec.local_world_size):
                self._procs.append(self._spawn(local_rank, for_rank0, joiner=spec.join))
        except BaseException:
            self._kill_all(signal.SIGKILL)
            self._reap_all()
            self._stop_agent()
            self._close_store_access()
            raise
        finally:
            if store_listener is not None:
                store_listener.close()  # rank 0 (or the agent) holds its own copy of the socket now

    def _start_agent(self, listener: socket.socket | None) -> None:
        """``--elastic``: this launcher's agent process (``launch/_agent``); it hosts the store
        when ``listener`` is the store's socket."""
        env = self._environment(0)
        self._agent = ElasticAgent(self._starter, self._spec.argv, env, self._spec.cwd, listener)
        self._starter = self._agent.starter

    def _stop_agent(self) -> None:
        if self._agent is not None:
            self._agent.stop()

    def _close_store_access(self) -> None:
        """The store's way in from other hosts, out to the chief, and the job's private network."""
        for access in (self._relay, self._chief_store, self._network):
            if access is not None:
                access.close()
        self._network = self._chief_store = None

    def _note_job(self, text: str) -> None:  # a peer without the secret (once), no private network
        self._note(SERVER_RANK, text)

    def _environment(self, local_rank: int) -> dict[str, str]:
        return process_env(self._spec, local_rank, self._port, self._store_port, self._secret.hex())

    def _spawn(self, local_rank: int, listener: socket.socket | None, *, joiner: bool = False) -> _Proc:
        spec = self._spec
        rank = spec.rank_offset + local_rank
        event_r, event_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        diagnose_r, diagnose_w = os.pipe()
        os.set_blocking(diagnose_w, False)
        env = self._environment(local_rank)
        env[EVENT_FD_VAR] = str(event_w)
        env[DIAGNOSE_FD_VAR] = str(diagnose_r)
        env.pop(STORE_ROLE_VAR, None)
        if joiner:
            env[ELASTIC_JOINER_VAR] = "1"
        env[INCARNATION_VAR] = str(self._respawned.get(rank, 0))
        pass_fds = [event_w, diagnose_r]
        if listener is not None and rank == 0:
            env[STORE_FD_VAR] = str(listener.fileno())
            pass_fds.append(listener.fileno())
        else:
            env.pop(STORE_FD_VAR, None)
        try:
            try:
                env[PARENT_PID_VAR] = str(self._starter.parent_pid())
                handle = self._starter.start(spec.argv, env, spec.cwd, stdout=out_w, stderr=err_w, pass_fds=pass_fds)
            except ZygoteUnavailable:
                self._starter = self._starter.cold()  # the warm interpreter is gone: start cold from now on
                env[PARENT_PID_VAR] = str(os.getpid())
                handle = self._starter.start(spec.argv, env, spec.cwd, stdout=out_w, stderr=err_w, pass_fds=pass_fds)
            if not self._starter.warm:
                self._cold_starts += 1
        except BaseException:
            for fd in (event_r, out_r, err_r, diagnose_w):
                os.close(fd)
            raise
        finally:
            for fd in (event_w, out_w, err_w, diagnose_r):
                os.close(fd)
        proc = _Proc(local_rank=local_rank, rank=rank, popen=handle, incarnation=self._respawned.get(rank, 0),
                     diagnose_w=diagnose_w)
        self._oom.started(rank, handle.pid)
        for fd, stream in ((out_r, "stdout"), (err_r, "stderr"), (event_r, "events")):
            os.set_blocking(fd, False)
            proc.fds[fd] = (stream, LineBuffer())
            self._selector.register(fd, selectors.EVENT_READ, proc)
        return proc

    # -- supervise ------------------------------------------------------------

    def _supervise(self) -> ProcessState:
        stopping_since: float | None = None
        state: ProcessState | None = None
        while True:
            self._pump(_TICK_S)
            if self._spec.elastic:
                self._lose += self._stopped.check({p.rank: p.popen.pid for p in self._running()}, time.monotonic())
            self._kill_lost()
            self._pass_on_preempt()
            self._poll_exits()
            running = [p for p in self._procs if p.returncode is None]
            if stopping_since is None:
                if self._stop.own(self._failures):
                    state = ProcessState.FAILED
                elif self._stop.kill_due() or (self._stop.decided and self._failures):
                    state = ProcessState.STOPPED  # a rank that died after the decision: kill the rest now
                if state is not None:
                    stopping_since = time.monotonic()
                    self._kill_all(signal.SIGTERM)
            if not running:
                if state is None and self._preempted:
                    return ProcessState.PREEMPTED
                return state if state is not None else ProcessState.SUCCEEDED
            if stopping_since is not None and time.monotonic() - stopping_since > self._spec.stop_grace_s:
                self._kill_all(signal.SIGKILL)

    def _pump(self, timeout_s: float) -> None:
        for key, _ in self._selector.select(timeout_s):
            proc: _Proc = key.data
            fd = key.fd
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            stream, buf = proc.fds[fd]
            if not data:
                self._selector.unregister(fd)
                os.close(fd)
                for line in buf.flush():
                    self._deliver(proc, stream, line)
                continue
            for line in buf.feed(data):
                self._deliver(proc, stream, line)

    def _deliver(self, proc: _Proc, stream: str, line: bytes) -> None:
        if stream == "events":
            try:
                event = decode_event(line)
            except EventDecodeError as exc:
                event = Output(rank=proc.rank, time=time.time(), stream="stderr", line=f"[distrun] bad event: {exc}")
            if isinstance(event, Failed) and proc.rank not in self._spec.independent_ranks:
                self._failures.append(event)
            elif isinstance(event, Step):
                self._oom.peak(proc.rank, event.peak_mem_mb)
        else:
            event = Output(rank=proc.rank, time=time.time(), stream=stream, line=line.decode("utf-8", "replace"))
        self._sink(event)

    def _poll_exits(self) -> None:
        for proc in list(self._procs):  # a respawn appends
            if proc.returncode is not None:
                continue
            rc = proc.popen.poll()
            if rc is None:
                continue
            proc.returncode = rc
            self._diagnose.close(proc)
            # Anything it spawned goes with it; then read its last words (its
            # Failed event) before deciding whether it failed.
            self._kill_group(proc, signal.SIGKILL)
            self._drain_proc(proc, deadline=time.monotonic() + 0.5)
            now = time.time()
            self._sink(Exited(rank=proc.rank, time=now, returncode=rc))
            if rc == PREEMPTED_EXIT_CODE and self._preempt_requested.is_set() and not proc.signalled:
                self._preempted.add(proc.rank)  # told to, it checkpointed with the others: not a failure
            elif (rc != 0 and not proc.signalled and self._spec.elastic and self._ps_task(proc.rank) is not None
                  and not any(f.rank == proc.rank for f in self._failures)):  # held its rows alone (launch/_exits)
                self._failures.append(ps_task_lost(exit_failure(self._oom, proc.rank, rc, now), self._ps_task(proc.rank)))
            elif rc != 0 and not proc.signalled and self._stop.decided:
                # The job is stopping (a peer on another host was killed first): part of the stop,
                # never respawned; its entry (stamped now, after the decision) ends the run at once.
                if not any(f.rank == proc.rank for f in self._failures):
                    self._failures.append(exit_failure(self._oom, proc.rank, rc, now))
            elif rc != 0 and not proc.signalled and proc.rank in self._spec.independent_ranks:
                failure = exit_failure(self._oom, proc.rank, rc, now)  # an OOM kill is worth saying, an exit code not
                self._respawn(proc, why=failure.message if failure.kind == OOM_KILLED else "")
            elif (rc != 0 and not proc.signalled and self._spec.elastic
                  and not any(f.rank == proc.rank for f in self._failures)):
                why = proc.lost_reason or exit_failure(self._oom, proc.rank, rc, now).message
                if self._agent is not None:  # the survivors need not wait for its beat to go stale
                    self._agent.lost(proc.rank, proc.incarnation, why)
                self._respawn(proc, why=why)
            elif rc != 0 and not proc.signalled and not any(f.rank == proc.rank for f in self._failures):
                lost = getattr(proc.popen, "lost_reason", None)
                self._failures.append(Failed(rank=proc.rank, time=now, kind="exited", message=lost) if lost
                                      else exit_failure(self._oom, proc.rank, rc, now))

    def _ps_task(self, rank: int) -> int | None:
        world = self._spec.world_size if self._spec.world_size is not None else self._spec.local_world_size
        return ps_task_of(rank, world, self._spec.num_ps)

    def _pass_on_preempt(self) -> None:
        if self._preempt_sent or not self._preempt_requested.is_set():
            return
        self._preempt_sent = True
        for proc in self._procs:
            if proc.returncode is None:
                try:
                    os.kill(proc.popen.pid, signal.SIGUSR1)
                except (ProcessLookupError, PermissionError):
                    pass

    def _kill_lost(self) -> None:
        while self._lose and self._spec.elastic:
            rank, why = self._lose.pop(0)
            for proc in self._procs:
                if proc.rank == rank and proc.returncode is None:
                    proc.lost_reason = why
                    try:
                        os.killpg(proc.popen.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass

    def _respawn(self, proc: _Proc, why: str = "") -> None:
        """Start a lost rank again (it rejoins the job), while respawns last.

        Independent ranks (parameter-server workers) and elastic ranks; an elastic rank
        comes back as a joiner, healed by a peer.
        """
        done = self._respawned.get(proc.rank, 0)
        lost = f"rank {proc.rank} lost ({why})" if why else f"rank {proc.rank} lost"
        if self._stop.decided or self._failures or done >= self._spec.respawns:
            self._note(proc.rank, f"{lost}; the job goes on without it")
            return
        self._respawned[proc.rank] = done + 1
        self._note(proc.rank, f"{lost}; starting it again ({done + 1}/{self._spec.respawns})")
        self._procs.append(self._spawn(proc.local_rank, None, joiner=self._spec.elastic))

    def _note(self, rank: int, text: str) -> None:
        self._sink(Output(rank=rank, time=time.time(), stream="stderr", line=f"[distrun] {text}"))

    # -- tear down ------------------------------------------------------------

    def _kill_group(self, proc: _Proc, sig: int) -> None:
        proc.signalled = proc.signalled or proc.returncode is None
        try:
            os.killpg(proc.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _kill_all(self, sig: int) -> None:
        for proc in self._procs:
            self._kill_group(proc, sig)

    def _reap_all(self) -> None:
        for proc in self._procs:
            try:
                rc = proc.popen.wait(timeout=self._spec.stop_grace_s)
            except subprocess.TimeoutExpired:
                self._kill_group(proc, signal.SIGKILL)
                rc = proc.popen.wait()
            if proc.returncode is None:
                proc.returncode = rc
                self._sink(Exited(rank=proc.rank, time=time.time(), returncode=rc))

    def _drain_proc(self, proc: _Proc, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not any(fd in self._selector.get_map() for fd in proc.fds):
                return
            self._pump(0.02)

    def _drain_pipes(self, deadline: float) -> None:
        while self._selector.get_map() and time.monotonic() < deadline:
            self._pump(0.02)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fd)
            try:
                os.close(key.fd)
            except OSError:
                pass
