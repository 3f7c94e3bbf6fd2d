"""Which failure a failed job is blamed for: one rule, wherever the job's failure is named.

A failure is named in three places: the launcher's ``RunResult`` (one host's ranks,
``launch/_stop``), a cluster job's outcome and restart line (every host's result, live,
``client/cluster_job``) and ``distrun jobs`` (every host's record, read later,
``client/_job_state``). Each once chose with its own tie-breaks, so the live view and
``distrun jobs`` could blame different hosts for one failure. This is the rule all three
use, strongest first:

1. a rank that failed on its own (any kind but ``PEER_LOST``): the others died of it;
2. a host with no rank failure to show (its server or the link to it was lost, or it
   recorded a failure this client cannot read): its ranks may have died unheard;
3. a rank that only lost a peer (``PEER_LOST``): a consequence, blamed only when
   nothing else is known.

Within a tier the earliest ``Failed.time`` wins; equal times go to the lower rank, then
to the host first by name (and a host of tier 2, which has no time, goes by name), so
the answer never depends on which host answered first.
"""

from __future__ import annotations

from collections.abc import Iterable

from distrun.protocol.events import PEER_LOST, Failed

__all__ = ["root_cause"]

_OWN, _HOST, _PEER = 0, 1, 2


def root_cause(failures: Iterable[tuple[str, Failed | None]]) -> tuple[str, Failed | None] | None:
    """The (host, failure) to blame from each host's (host, its rank's ``Failed``, or None for a
    host that failed without one); None when there is nothing to blame. A caller with a single
    host (the launcher) passes any one label for all."""

    def order(record: tuple[str, Failed | None]) -> tuple[int, float, int, str]:
        host, failure = record
        if failure is None:
            return (_HOST, 0.0, 0, host)
        return (_PEER if failure.kind == PEER_LOST else _OWN, failure.time, failure.rank, host)

    return min(failures, key=order, default=None)
