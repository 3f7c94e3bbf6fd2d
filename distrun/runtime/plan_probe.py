"""``python -m distrun.runtime.plan_probe REQUEST_JSON``: the planner's probe, in its own process.

The client (which never imports torch) starts it before a ``--strategy auto`` job or for
``distrun plan``: it loads the recipe as a rank would, builds its model and optimizer with the
job's seed, and measures them (``distrun.planner.probe``) in as many processes as the job has
ranks on this host, all at once, each with the threads one rank gets: a rank computes while its
neighbours compute. Those processes then time gloo's all-reduce among themselves, which is the
link the ranks' gradients will take (one process alone times a loopback socket). It prints one
line, ``PLAN_PROBE_MARK`` and a JSON object: the first process's profile, the link, and the
device's free memory on a GPU. A recipe that raises is the recipe's error: the JSON then holds
``error`` (one line) and ``location`` (file, line), and the process exits 3; a peer that dies
(the OOM killer) ends the probe at once, its signal named.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from distrun.config import PLAN_PROBE_MARK

#: Bytes pushed through the loopback link, and the small round trips timed for its latency.
_LINK_BYTES = 16 << 20
_ROUND_TRIPS = 200
#: Probe processes that measure at once (the job's ranks on this host, at most this many).
_MAX_PEERS = 8


def _loopback_link() -> dict[str, float]:
    """A loopback TCP link's rate and one message's latency: what gloo's ranks on one host use."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = [0]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(_ROUND_TRIPS):
                conn.sendall(conn.recv(1))
            while received[0] < _LINK_BYTES:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                received[0] += len(chunk)
            conn.sendall(b"k")

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        trips = []
        for _ in range(_ROUND_TRIPS):
            start = time.perf_counter()
            client.sendall(b"x")
            client.recv(1)
            trips.append(time.perf_counter() - start)
        payload = b"\0" * (1 << 20)
        start = time.perf_counter()
        for _ in range(_LINK_BYTES >> 20):
            client.sendall(payload)
        client.recv(1)
        elapsed = time.perf_counter() - start
    thread.join(timeout=5)
    server.close()
    return {"bytes_per_s": _LINK_BYTES / elapsed, "latency_s": statistics.median(trips) / 2}


def _probe(request: dict[str, Any], rank: int, group_size: int, store_dir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from distrun.runtime._probe_recipe import measure_recipe
    from distrun.runtime._recipe import load_module, prepare_sys_path

    torch.set_num_threads(max(1, int(request["threads"])))
    prepare_sys_path(request["recipe"], tuple(request.get("args", ())))
    if group_size > 1:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), group_size),
                                rank=rank, world_size=group_size, timeout=datetime.timedelta(seconds=60))
    import distrun.runtime._main  # noqa: F401 - what a rank imports before its model: its floor
    if request.get("evaluates"):
        import distrun.runtime._metrics  # noqa: F401 - torchmetrics, which a rank imports to evaluate
    device = torch.device(request.get("device", "cpu"))
    _, last = measure_recipe(load_module(request["recipe"]), request, rank, group_size, device)
    measured = last()
    if group_size > 1:
        dist.destroy_process_group()
    return {**measured, "link": measured["link"] or _loopback_link()}


def _fork_peers(count: int) -> tuple[int, list[int]]:
    """This process's place among ``count`` probe processes (0: this one, which reports), and the
    peers' pids (the first process's to end)."""
    pids = []
    for rank in range(1, count):
        pid = os.fork()
        if pid == 0:
            return rank, []
        pids.append(pid)
    return 0, pids


#: How long the first process waits, after its own error, for a dying peer's watcher to speak first.
_PEER_GRACE_S = 1.0


def _say(reply: dict[str, Any]) -> None:
    """The probe's one reply: a marked line, written whole, which the recipe's own prints never are."""
    sys.stdout.write(PLAN_PROBE_MARK + json.dumps(reply) + "\n")
    sys.stdout.flush()


#: Taken by whoever speaks for the probe: its first process with its reply or its error, or the
#: watcher of a peer that died. Only one JSON line is ever printed.
_SPEAKING = threading.Lock()


def _error_reply(exc: BaseException, recipe: str) -> dict[str, Any]:
    """The recipe's error, one line, with the recipe's own line it was raised at where there is one."""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(frame.filename) == os.path.abspath(recipe)]
    location = [frames[-1].filename, frames[-1].lineno] if frames else None
    return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0], "location": location,
            "detail": traceback.format_exc()}


def _peer_error(store_dir: str, rank: int) -> str:
    return os.path.join(store_dir, f"error-{rank}.json")


def _watch_peers(peers: list[int], store_dir: str) -> list[threading.Thread]:
    """End the probe at once when a peer dies before it is done: the first process would otherwise
    wait the group's timeout for it, and then name gloo's timeout instead of the cause (a peer's own
    error, which it leaves in the store's folder, or the signal that killed it)."""
    def watch(rank: int, pid: int) -> None:
        with contextlib.suppress(ChildProcessError):
            _, status = os.waitpid(pid, 0)
            if status == 0 or not _SPEAKING.acquire(blocking=False):
                return
            killed = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            try:
                with open(_peer_error(store_dir, rank), encoding="utf-8") as file:
                    reply = json.load(file)
            except (OSError, ValueError):
                reply = {"error": f"probe process {rank} was killed by signal {killed}" if killed else
                         f"probe process {rank} failed (exit {os.WEXITSTATUS(status)})", "location": None,
                         "killed_signal": killed}
            _say(reply)
            for other in peers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
            os._exit(3)

    threads = [threading.Thread(target=watch, args=(rank, pid), daemon=True)
               for rank, pid in enumerate(peers, start=1)]
    for thread in threads:
        thread.start()
    return threads


def main() -> None:
    request = json.loads(sys.argv[1])
    started = time.perf_counter()
    group_size = max(1, min(int(request.get("ranks_here", 1)), _MAX_PEERS))
    import torch  # noqa: F401 - before the fork, as the warm zygote does: each peer starts with it

    with tempfile.TemporaryDirectory(prefix="distrun-probe-") as store_dir:
        rank, peers = _fork_peers(group_size)
        if rank:  # a peer: measure beside the first, then leave; its own error goes to stderr
            code = 0
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    _probe(request, rank, group_size, store_dir)
            except BaseException as exc:  # noqa: BLE001 - the first process says it
                with open(_peer_error(store_dir, rank), "w", encoding="utf-8") as file:
                    json.dump(_error_reply(exc, request["recipe"]), file)
                code = 3
            finally:
                sys.stderr.flush()
                os._exit(code)
        watchers = _watch_peers(peers, store_dir)
        try:
            reply = _probe(request, 0, group_size, store_dir)
        except Exception as exc:  # noqa: BLE001 - the recipe's error, named where it was raised
            # A peer killed (the OOM killer) breaks this process's collectives as it dies: give its
            # watcher the moment it needs to say so first, the cause rather than gloo's symptom.
            time.sleep(_PEER_GRACE_S)
            if not _SPEAKING.acquire(blocking=False):
                time.sleep(60)  # a peer's watcher is saying why, and ends the process
            for pid in peers:  # they would wait for this process in the group that will not form
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _say(_error_reply(exc, request["recipe"]))
            os._exit(3)
        for watcher in watchers:  # the peers end after their last collective; the store outlives them
            watcher.join(timeout=30)
        for pid in peers:  # one still running past that is stuck: it would hold the client's pipe open
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if _SPEAKING.acquire(blocking=False):
        reply["probe_s"] = time.perf_counter() - started
        _say(reply)


if __name__ == "__main__":
    main()
