"""Stopping a job on every host as one decision (``distrun cancel``, Ctrl-C, a failed host).

Hosts are stopped over separate connections, so some are always told before others.
Were the first host's ranks killed at once, a rank on a host not yet told would see
its peer vanish, raise, and its server would record the job ``failed``. So the stop
has two phases: every host first learns that the job is stopping (``stopping``: a
rank that dies from then on is part of the stop, ``launch/_stop``), and only then is
each asked to kill its ranks (``cancel``). A host that cannot be reached in either
phase is skipped, not waited for; its server's own lease ends the job there.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from distrun.client._links import HostLink
from distrun.errors import HostError

__all__ = ["stop_everywhere", "by_whom"]


def by_whom(what: str = "cancelled") -> str:
    """``what`` "by <user> from <host>": the reason every host records and `distrun jobs` shows."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's)
        user = "an unnamed user"
    return f"{what} by {user} from {socket.gethostname()}"


def stop_everywhere(links: Sequence[HostLink], job_id: str, reason: str) -> list[HostError]:
    """Tell every host that ``job_id`` is stopping, then have each kill its ranks; the errors of
    hosts that could not be reached (the others are stopped all the same)."""
    failed: dict[str, HostError] = {}

    def call(link: HostLink, verb: str) -> None:
        if link.label in failed:
            return
        try:
            link.call(verb, job=job_id, reason=reason)
        except HostError as exc:
            failed[link.label] = exc

    with ThreadPoolExecutor(max_workers=max(1, min(32, len(links)))) as pool:
        for verb in ("stopping", "cancel"):  # every host has the decision before any rank dies
            list(pool.map(lambda link: call(link, verb), links))
    return list(failed.values())
