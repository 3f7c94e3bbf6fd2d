"""Stopping a job on every host as one decision (``distrun cancel``, Ctrl-C, a failed host).

Hosts are stopped over separate connections, so some are always told before others.
Were the first host's ranks killed at once, a rank on a host not yet told would see
its peer vanish, raise, and its server would record the job ``failed``. So the stop
has two phases: every host first learns that the job is stopping (``stopping``: a
rank that dies from then on is part of the stop, ``launch/_stop``), and only then is
each asked to kill its ranks (``cancel``).

Every host gets the second phase whatever the first answered: a server that refused
``stopping`` (another version's) or missed it still decides at ``cancel``. Each phase
waits at most ``PHASE_S`` for the slowest host (a host that hangs must not hang Ctrl-C),
which is well inside the time a server waits for the kill it was promised
(``launch/_stop.DEFAULT_KILL_AFTER_S``).
"""

from __future__ import annotations

import getpass
import socket
import threading
import time
from collections.abc import Sequence

from distrun.client._links import HostLink
from distrun.errors import HostError

__all__ = ["stop_everywhere", "by_whom", "PHASE_S"]

#: The longest one phase waits for its slowest host.
PHASE_S = 10.0


def by_whom(what: str = "cancelled") -> str:
    """``what`` "by <user> from <host>": the reason every host records and `distrun jobs` shows."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's)
        user = "an unnamed user"
    return f"{what} by {user} from {socket.gethostname()}"


def stop_everywhere(links: Sequence[HostLink], job_id: str, reason: str) -> list[HostError]:
    """Tell every host that ``job_id`` is stopping, then have each kill its ranks; the errors of
    the hosts whose kill failed or did not answer in time (the others are stopped all the same)."""
    failed: dict[str, HostError] = {}
    for verb in ("stopping", "cancel"):  # every host has the decision before any rank dies
        failed = _each(links, verb, job_id, reason)
    return list(failed.values())


def _each(links: Sequence[HostLink], verb: str, job_id: str, reason: str) -> dict[str, HostError]:
    """``verb`` on every link at once; at most PHASE_S for all of them (daemon threads: a host
    that never answers is left behind, not waited for)."""
    failed: dict[str, HostError] = {}

    def call(link: HostLink) -> None:
        try:
            link.call(verb, job=job_id, reason=reason)
        except HostError as exc:
            failed[link.label] = exc

    threads = [threading.Thread(target=call, args=(link,), name=f"{verb}-{link.label}", daemon=True)
               for link in links]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + PHASE_S
    for link, thread in zip(links, threads):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            failed.setdefault(link.label, HostError(link.label, f"no answer to {verb!r} within {PHASE_S:.0f} s"))
    return failed
