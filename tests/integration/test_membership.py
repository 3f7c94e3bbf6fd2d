"""Elastic membership with real processes, a real TCPStore and real gloo groups.

The store is held by this test process, which outlives the members as the job's store
outlives its ranks. One member is SIGKILLed with an all-reduce in flight; the survivors
must notice (their collective fails, or their watcher aborts it), form a new group
without it, agree on the committed step and go on.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from distrun.strategies.elastic.membership import STORE_PREFIX, BelowMinimum, Membership

from tests._sshd import free_port
from tests.conftest import REPO


def test_survivors_form_a_new_group_and_lose_no_committed_step() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    members, die_at, steps = 3, 20, 40
    procs = [subprocess.Popen([sys.executable, "-m", "tests.integration._elastic_member", str(port), str(member),
                               str(members), str(die_at), str(steps)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for member in range(members)]
    try:
        outs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert procs[-1].returncode == -9  # the lost member
    reports = []
    for proc, (out, err) in zip(procs[:-1], outs[:-1]):
        assert proc.returncode == 0, err[-2000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    print(reports)
    for report in reports:
        assert report["worlds"] == [3, 2] and report["generation"] == 2
    # Steps before the loss summed 1+2+3, the rest 1+2. The step in flight either completed
    # for some survivor (the lost member had sent its part) or for none; either way both
    # survivors end with the same total: the one with more committed steps healed the other.
    assert reports[0]["total"] == reports[1]["total"]
    assert reports[0]["total"] in (die_at * 6 + (steps - die_at) * 3, (die_at + 1) * 6 + (steps - die_at - 1) * 3)
    assert sorted(report["rank"] for report in reports) == [0, 1]
    del store


class _Gate:
    """A TCP forwarder to the store that can hold its bytes: a cut link, as a member sees it
    (no error, no answer), then the link back, when the held bytes go through."""

    def __init__(self, port: int) -> None:
        self.open = threading.Event()
        self.open.set()
        self._upstream = port
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._upstream))
            self._sockets += [conn, upstream]
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.open.wait()
                dst.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        """Every connection broken, as when the store is gone."""
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def test_round_over_waits_while_the_watcher_cannot_read_the_record() -> None:
    """A member whose link was down cannot tell a peer's reset from its recipe's error until its
    watcher reads the store again: ``round_over`` waits for that read, not just 3 s."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    gate = _Gate(store.port)
    membership = Membership(lambda: dist.TCPStore("127.0.0.1", gate.port, is_master=False,
                                                  timeout=timedelta(seconds=30)), 0, timeout=timedelta(seconds=30))
    started = time.monotonic()
    assert membership.round_over(wait_s=0.5) is False  # the watcher reads: every peer alive, nothing over
    assert time.monotonic() - started < 1.5

    gate.open.clear()  # the link goes down for 4 s
    threading.Timer(4.0, gate.open.set).start()
    time.sleep(1.5)  # past LOST_AFTER_S without a read
    started = time.monotonic()
    assert membership.round_over(wait_s=0.5) is False  # the record, read again, says nothing either
    waited = time.monotonic() - started
    assert waited > 2.0, waited  # until the link came back (2.5 s from here), not the 0.5 s asked for

    gate.cut()  # the store is gone for good: the watcher ends, and the member is cut off from the job
    started = time.monotonic()
    assert membership.round_over(wait_s=0.5) is True
    assert time.monotonic() - started < 5


def test_a_round_of_joiners_alone_falls_back_rather_than_train_from_scratch() -> None:
    """Every member that held the job's state is gone and only new ones arrive: healing from a
    joiner would start training over under the job's step count. The round refuses instead."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    store.set(f"{STORE_PREFIX}/g0/closed", "2")  # the job's first round, whose members are all gone now
    errors: list[BaseException] = []

    def join() -> None:
        joiner = Membership(lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                                  timeout=timedelta(seconds=30)), None, timeout=timedelta(seconds=30))
        try:
            joiner.join_round(joiner.open_joiners_round(), -1, patient=True)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)
        finally:
            joiner.close()

    threads = [threading.Thread(target=join) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(errors) == 2 and all(isinstance(exc, BelowMinimum) for exc in errors), errors
    assert "no replica left holds the job's state" in str(errors[0])
