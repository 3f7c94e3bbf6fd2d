"""Elastic membership with real processes, a real TCPStore and real gloo groups.

The store is held by this test process, which outlives the members as the job's store
outlives its ranks. One member is SIGKILLed with an all-reduce in flight; the survivors
must notice (their collective fails, or their watcher aborts it), form a new group
without it, agree on the committed step and go on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

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
