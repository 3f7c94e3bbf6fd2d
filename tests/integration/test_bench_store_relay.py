"""A store round trip through the job's guarded doors against a plain TCPStore, in one run (`pytest -m bench`).

The figures of docs/security.md ("Why a relay"): one client, in a process of its own as a
rank is, times `add` round trips on three paths to torch's TCPStore, interleaved round by round:

- straight: a plain TCPStore on loopback, as a torchrun job's store is;
- the chief's relay: the store in a network of its own (``launch/_chief_store``), reached by the
  chief host's ranks through the relay on the host's 127.0.0.1;
- another host's relay and the front: the relay proves the job secret to the front (on
  127.0.0.2 here, the cluster address's stand-in), which splices the bytes into the store's network.

It prints each path's median µs per round trip and its ratio to the straight one:

    python3 -m pytest -m bench tests/integration/test_bench_store_relay.py -s

DISTRUN_BENCH_ROUND_TRIPS (1000) round trips a path per round, DISTRUN_BENCH_REPEATS (5) rounds.
Speed is not asserted.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from distrun.launch._chief_store import ChiefStore
from distrun.launch._store_relay import StoreFront, StoreRelay

pytestmark = pytest.mark.bench

SECRET = bytes(range(32))

#: The client: a rank's process, with torch's own store client on each path's port.
_CLIENT = r"""
import json, sys, time
from datetime import timedelta
import torch.distributed as dist

ports, n, rounds = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
clients = {name: dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30)) for name, port in ports.items()}
for client in clients.values():  # connected, and warm
    for _ in range(100):
        client.add("bench/warm", 1)
us = {name: [] for name in clients}
for _ in range(rounds):
    for name, client in clients.items():
        started = time.perf_counter()
        for _ in range(n):
            client.add("bench/counter", 1)
        us[name].append((time.perf_counter() - started) / n * 1e6)
print(json.dumps(us))
"""


def test_store_round_trips_through_the_relays_against_a_plain_store() -> None:
    n = int(os.environ.get("DISTRUN_BENCH_ROUND_TRIPS", "1000"))
    rounds = int(os.environ.get("DISTRUN_BENCH_REPEATS", "5"))
    notes: list[str] = []
    plain = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    chief = ChiefStore(notes.append)
    front = relay = None
    try:
        # rank 0's way: the store on the chief's socket (inside its network where one could be made)
        store = dist.TCPStore("127.0.0.1", chief.port, None, True, timedelta(seconds=30),
                              wait_for_workers=False, master_listen_fd=chief.listener.fileno())
        listener = socket.socket()
        listener.bind(("127.0.0.2", 0))
        listener.listen(64)
        front = StoreFront(listener, SECRET, chief.connect, notes.append)
        relay = StoreRelay.to_front(front.address, SECRET, notes.append)
        ports = {"straight (plain TCPStore, loopback)": plain.port}
        if chief.private:
            ports["the chief's relay (store in its own network)"] = chief.port
        ports["another host's relay and the front"] = relay.port
        ran = subprocess.run([sys.executable, "-c", _CLIENT, json.dumps(ports), str(n), str(rounds)],
                             capture_output=True, text=True, timeout=600)
        assert ran.returncode == 0, ran.stderr[-3000:]
        us = json.loads(ran.stdout.strip().splitlines()[-1])
        assert store.add("bench/counter", 0) == n * rounds * (len(ports) - 1)  # the guarded paths reached it
    finally:
        for door in (relay, front):
            if door is not None:
                door.close()
        chief.listener.close()
        chief.close()
    straight = statistics.median(us["straight (plain TCPStore, loopback)"])
    rows = [{"path": name, "us_per_round_trip": round(statistics.median(runs), 1),
             "runs": [round(x, 1) for x in runs], "ratio": round(statistics.median(runs) / straight, 2)}
            for name, runs in us.items()]
    report = {"round_trips": n, "rounds": rounds, "cpus": os.cpu_count(), "private_network": chief.private,
              "notes": notes, "rows": rows}
    print(json.dumps(report, indent=1))
    for row in rows:
        print(f"{row['path']}: {row['us_per_round_trip']} µs per round trip, {row['ratio']}x straight")
    assert all(row["us_per_round_trip"] > 0 for row in rows)
