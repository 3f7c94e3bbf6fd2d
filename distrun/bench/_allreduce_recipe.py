"""`distrun bench allreduce`: the nccl-tests view of a cluster, run as a custom loop on it.

Shipped and run by ``distrun train --cluster FILE -s multi-worker`` like any recipe,
so it measures the very process groups a job gets. Rank 0 prints one JSON line.

1. **Links.** For each pair of hosts, one pair at a time (so no two streams share a
   link), the lower host's first rank streams raw TCP (plain sockets, no torch) to the
   higher host's first rank for ``--link-s`` seconds. The receiver counts the bytes
   between the first and the last, which is the link's rate in that direction. Its
   listener binds its host's cluster address, and it counts only a sender that proved
   the job secret (the control plane's handshake, kind ``link-probe``): anyone else who
   connects is named once and turned away, so no one can fake a rate.
2. **All-reduce.** For each size, ``flat`` (one ``all_reduce`` over every rank, DDP's
   path) and ``hierarchical`` (distrun's reduce inside each host, all-reduce across
   leaders, broadcast inside each host) each run one untimed operation, then
   ``--repeats`` back to back. The time is the slowest rank's mean.
   algbw = bytes / time, and busbw = algbw x 2(n-1)/n, as nccl-tests defines them, so
   busbw can be compared with a link's rate whatever n is.

Sizes are in MB of 2^20 bytes (as DDP's ``bucket_cap_mb``). Rates are in MB/s of 10^6
bytes (as links are sold: 200 Mbit/s = 25 MB/s).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from distrun.protocol.environment import CHIEF_ADDR_VAR
from distrun.protocol.secret import job_secret_from
from distrun.launch._store_relay import deadline
from distrun.protocol.wire import WireError, client_handshake, server_handshake
from distrun.strategies.communication.hierarchical import HierarchicalAllReduce, host_groups

_CHUNK = 1 << 20
PROBE_KIND = "link-probe"
_HANDSHAKE_S = 5.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", default="1,4,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--link-s", type=float, default=1.0)
    return parser.parse_args(argv)


def _gather_ints(values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (same length everywhere), without pickling."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def _own_address() -> bytes:
    """The address other hosts reach this one at: the source address of the route to the chief."""
    master = os.environ.get(CHIEF_ADDR_VAR) or os.environ.get("MASTER_ADDR", "127.0.0.1")
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((master, 9))  # UDP: no packet is sent; the kernel only picks a route
        address = probe.getsockname()[0]
    return socket.inet_pton(family, address).ljust(16, b"\0") + bytes([6 if family == socket.AF_INET6 else 4])


def _decode_address(raw: list[int]) -> str:
    family = socket.AF_INET6 if raw[16] == 6 else socket.AF_INET
    return socket.inet_ntop(family, bytes(raw[:16] if family == socket.AF_INET6 else raw[:4]))


def _receive(listener: socket.socket, secret: bytes) -> float:
    """Bytes per second between the first and the last byte of one stream, from the first
    connection that proves the job secret."""
    refused: set[str] = set()
    while True:
        conn, peer = listener.accept()  # the listener's timeout bounds the wait
        conn.settimeout(_HANDSHAKE_S)
        try:
            with deadline(conn, _HANDSHAKE_S):  # in all, not per recv
                server_handshake(conn, secret, kind=PROBE_KIND)
            break
        except (WireError, OSError):
            if peer[0] not in refused:
                refused.add(peer[0])
                print(f"[distrun] refused a link-probe connection from {peer[0]}: it did not prove the job secret",
                      file=sys.stderr, flush=True)
            conn.close()
    conn.settimeout(60)
    with conn:
        first = conn.recv(_CHUNK)
        start, received = time.perf_counter(), 0
        while first:
            chunk = conn.recv(_CHUNK)
            if not chunk:
                break
            received += len(chunk)
        return received / max(time.perf_counter() - start, 1e-9)


def _send(address: str, port: int, seconds: float, secret: bytes) -> None:
    payload = b"\0" * _CHUNK
    with socket.create_connection((address, port), timeout=60) as conn:
        client_handshake(conn, secret, kind=PROBE_KIND)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.sendall(payload)


def measure_links(rank: int, leaders: list[int], addresses: list[str], seconds: float,
                  device: torch.device) -> list[dict[str, object]]:
    """Each pair of hosts' rate (lower host sending), one pair at a time; every rank takes part."""
    secret = job_secret_from(os.environ)
    links = []
    for i, sender in enumerate(leaders):
        for j in range(i + 1, len(leaders)):
            receiver = leaders[j]
            port = torch.zeros(1, dtype=torch.int64, device=device)
            listener = None
            if rank == receiver:
                family = socket.AF_INET6 if ":" in addresses[receiver] else socket.AF_INET
                listener = socket.socket(family, socket.SOCK_STREAM)
                listener.bind((addresses[receiver], 0))  # its cluster address, never every interface
                listener.listen(1)
                listener.settimeout(60)  # a sender that cannot connect ends the benchmark, not hangs it
                port[0] = listener.getsockname()[1]
            dist.broadcast(port, src=receiver)
            rate = torch.zeros(1, dtype=torch.float64, device=device)
            if rank == sender:
                _send(addresses[receiver], int(port.item()), seconds, secret)
            elif listener is not None:
                with listener:
                    rate[0] = _receive(listener, secret)
            dist.broadcast(rate, src=receiver)
            links.append({"from_host": i, "to_host": j, "MBps": float(rate.item()) / 1e6})
    return links


def time_all_reduce(fn: Callable[[torch.Tensor], object], buffer: torch.Tensor, repeats: int) -> float:
    """The slowest rank's mean seconds per operation, after one untimed operation."""
    cuda = buffer.device.type == "cuda"
    fn(buffer)
    dist.barrier()
    if cuda:
        torch.cuda.synchronize(buffer.device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(buffer)
    if cuda:
        torch.cuda.synchronize(buffer.device)
    mean = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64, device=buffer.device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return float(mean.item())


def main(strategy) -> None:  # noqa: ANN001 - the recipe API
    args = parse_args(sys.argv[1:])
    sizes_mb = [float(part) for part in args.sizes_mb.split(",") if part]  # none: the links alone (doctor --links)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = strategy.device if dist.get_backend() == "nccl" else torch.device("cpu")
    node = int(os.environ.get("GROUP_RANK", "0"))
    every = _gather_ints([node, *_own_address()], device)
    nodes = [row[0] for row in every]
    addresses = [_decode_address(row[1:]) for row in every]
    groups = host_groups(nodes)
    leaders = [ranks[0] for ranks in groups]
    links = measure_links(rank, leaders, addresses, args.link_s, device)
    hierarchical = HierarchicalAllReduce(nodes)
    algorithms = {"flat": dist.all_reduce, "hierarchical": hierarchical.all_reduce_mean}
    rows = []
    for size_mb in sizes_mb:
        buffer = torch.zeros(max(1, int(size_mb * 2**20) // 4), dtype=torch.float32, device=device)
        size_bytes = buffer.numel() * 4
        for name, fn in algorithms.items():
            seconds = time_all_reduce(fn, buffer, args.repeats)
            algbw = size_bytes / seconds / 1e6
            rows.append({"algorithm": name, "size_mb": size_mb, "time_ms": seconds * 1e3, "algbw_MBps": algbw,
                         "busbw_MBps": algbw * 2 * (world - 1) / world})
        del buffer
    hierarchical.close()
    if rank == 0:
        slowest = min((link["MBps"] for link in links), default=None)
        print(json.dumps({"bench": "allreduce", "world_size": world, "hosts": len(groups),
                          "ranks_per_host": [len(ranks) for ranks in groups], "repeats": args.repeats,
                          "links": links, "link_MBps_min": slowest, "rows": rows}), flush=True)
