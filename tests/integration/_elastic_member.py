"""One member of the membership test (tests/integration/test_membership.py), run as a process.

``python -m tests.integration._elastic_member PORT ID MEMBERS DIE_AT STEPS``: joins the
first round with MEMBERS members, then all-reduces ``ID + 1`` into a running total each
step. Member ``MEMBERS - 1`` SIGKILLs itself inside the all-reduce of step DIE_AT. The
survivors open a round, heal the total from the member with the most committed steps and
carry on. Prints one JSON line at the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from distrun.strategies.elastic.membership import Membership


def main() -> None:
    port, member, members, die_at, steps = (int(arg) for arg in sys.argv[1:6])
    membership = Membership(lambda: dist.TCPStore("127.0.0.1", port, is_master=False,
                                                  timeout=timedelta(seconds=30)),
                            member, timeout=timedelta(seconds=30))
    round_ = membership.join_round(membership.open_round(), 0, expect=members)
    total = torch.zeros(1, dtype=torch.float64)
    step, history, recovery = 0, [round_.world_size], []
    while step < steps:
        contribution = torch.full((1,), float(member + 1), dtype=torch.float64)
        failed_at = None
        try:
            if member == members - 1 and step == die_at:  # die with the all-reduce in flight
                threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
                time.sleep(0.01)
            dist.all_reduce(contribution)
            if member == members - 1 and step == die_at:
                time.sleep(1)  # the timer fires: never past here
        except RuntimeError:
            failed_at = time.monotonic()
        if failed_at is not None:
            # Outside the except: its traceback holds torch's frames, and they hold the group.
            membership.drop_group()  # first: peers blocked on it wake now
            round_ = membership.join_round(membership.open_round(), step, min_members=1)
            state = torch.tensor([total.item(), float(step)], dtype=torch.float64)
            dist.broadcast(state, round_.source)  # heal from the member with the most committed steps
            total, step = state[:1].clone(), int(state[1].item())
            history.append(round_.world_size)
            recovery.append(time.monotonic() - failed_at)
            failed_at = None
            continue
        total += contribution
        step += 1
    print(json.dumps({"member": member, "total": total.item(), "worlds": history, "rank": round_.rank,
                      "recovery_s": recovery, "generation": round_.generation}), flush=True)
    dist.destroy_process_group()
    membership.close()


if __name__ == "__main__":
    main()
