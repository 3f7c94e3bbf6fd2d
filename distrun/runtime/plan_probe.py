"""``python -m distrun.runtime.plan_probe REQUEST_JSON``: the planner's probe, in its own process.

The client (which never imports torch) starts it before a ``--strategy auto`` job or for
``distrun plan``: it loads the recipe as a rank would, builds its model and optimizer with the
job's seed, and measures them (``distrun.planner.probe``) in as many processes as the job has
ranks on this host, all at once, each with the threads one rank gets: a rank computes while its
neighbours compute. Those processes then time gloo's all-reduce among themselves, which is the
link the ranks' gradients will take (one process alone times a loopback socket). It prints one
JSON object: the first process's profile, the link, and the device's free memory on a GPU. A recipe that raises is the recipe's error: the
JSON then holds ``error`` (one line) and ``location`` (file, line), and the process exits 3.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

#: Bytes pushed through the loopback link, and the small round trips timed for its latency.
_LINK_BYTES = 16 << 20
_ROUND_TRIPS = 200
#: Probe processes that measure at once (the job's ranks on this host, at most this many), and the
#: largest all-reduce they time.
_MAX_PEERS = 8
_MAX_COLLECTIVE_BYTES = 64 << 20


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

    from distrun.planner.overheads import collective_rates, framework_overheads
    from distrun.runtime._loop_probe import loop_step_s
    from distrun.planner.probe import measure, resident_bytes
    from distrun.runtime._move import to_device
    from distrun.runtime._recipe import load_module, prepare_sys_path
    from distrun.strategies import InputContext
    from distrun.strategies.step.accumulation import batch_rows, split_batch

    torch.set_num_threads(max(1, int(request["threads"])))
    prepare_sys_path(request["recipe"], tuple(request.get("args", ())))
    if group_size > 1:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), group_size),
                                rank=rank, world_size=group_size, timeout=datetime.timedelta(seconds=60))
    import distrun.runtime._main  # noqa: F401 - what a rank imports before its model: its floor
    if request.get("evaluates"):
        import distrun.runtime._metrics  # noqa: F401 - torchmetrics, which a rank imports to evaluate
    device = torch.device(request.get("device", "cpu"))
    # A rank's floor as its summary counts peaks: on CPU the process (the interpreter, torch, distrun,
    # a process group), on a GPU what CUDA's allocator holds (the context is outside it, and outside
    # the free memory the budget reads).
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else resident_bytes()
    recipe = load_module(request["recipe"])
    batch_size, rows = int(request["global_batch_size"]), int(request["rows"])
    torch.manual_seed(int(request.get("seed", 0)))
    model = recipe.model()
    data = recipe.train_data(InputContext(1, 0, batch_size, int(request.get("seed", 0))))
    collate = torch.utils.data.default_collate
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        def batch_of(count: int) -> Any:
            return collate([data[i % len(data)] for i in range(count)])
    else:  # an iterable of batches: the first, cut to size
        first = next(iter(data))

        def batch_of(count: int) -> Any:
            have = batch_rows(first) or count
            return split_batch(first, max(1, have // count))[0][0] if have > count else first

    forward = getattr(recipe, "forward", lambda m, b: m(b[0]))
    # Every process of the probe measures at once, as the job's ranks will compute at once on
    # this host's cores and memory.
    profile = measure(model=model, make_optimizer=recipe.optimizer, loss_fn=recipe.loss, forward=forward,
                      batch_of=lambda count: to_device(batch_of(count), device), rows=rows, device=device, base_bytes=base,
                      units_from=getattr(recipe, "shard_units", None), chain_from=getattr(recipe, "pp_chain", None),
                      together=dist.barrier if group_size > 1 else lambda: None,
                      # A rank's budget (the client's, on CPU) or the GPU's free memory.
                      memory_cap_bytes=request.get("memory_cap_bytes") or (
                          int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None),
                      time_sharded=group_size > 1)
    link, overheads = None, {}
    if group_size > 1:
        rates = collective_rates(min(profile.gradient_bytes, _MAX_COLLECTIVE_BYTES))
        link = {"bytes_per_s": rates.pop("bytes_per_s"), "latency_s": rates.pop("latency_s")}
        overheads = {**framework_overheads(device), **rates}
    overheads["loop_step_s"] = loop_step_s(rank, group_size, device)
    if group_size > 1:
        dist.destroy_process_group()
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    return {"profile": dataclasses.asdict(profile), "link": link or _loopback_link(), "device_free_bytes": free,
            "overheads": overheads}


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


def main() -> None:
    request = json.loads(sys.argv[1])
    started = time.perf_counter()
    group_size = max(1, min(int(request.get("ranks_here", 1)), _MAX_PEERS))
    import torch  # noqa: F401 - before the fork, as the warm zygote does: each peer starts with it

    with tempfile.TemporaryDirectory(prefix="distrun-probe-") as store_dir:
        rank, peers = _fork_peers(group_size)
        if rank:  # a peer: measure beside the first, then leave without a word
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    _probe(request, rank, group_size, store_dir)
            finally:
                os._exit(0)
        try:
            reply = _probe(request, 0, group_size, store_dir)
        except Exception as exc:  # noqa: BLE001 - the recipe's error, named where it was raised
            for pid in peers:  # they would wait for this process in the group that will not form
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
                      if os.path.abspath(frame.filename) == os.path.abspath(request["recipe"])]
            location = [frames[-1].filename, frames[-1].lineno] if frames else None
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}".splitlines()[0], "location": location,
                              "detail": traceback.format_exc()}))
            sys.exit(3)
        finally:
            for pid in peers:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
    reply["probe_s"] = time.perf_counter() - started
    print(json.dumps(reply))


if __name__ == "__main__":
    main()
