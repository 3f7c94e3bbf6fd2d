"""Each cluster's links as ``--strategy auto``'s last probe there timed them, kept for a day.

Timing the collectives over a slow network is the slow part of a cluster probe (a 100 Mbit link
takes seconds a collective on a model's gradients), and links change far less often than the
recipe. So the client keeps the figures a probe timed in ``$DISTRUN_HOME/links/``, one small JSON
file per cluster, named by a hash of what the figures depend on: the hosts the job runs on (label,
address, slots), the cluster's network interface, and the device. A cluster whose hosts or slots
changed hashes to another file, so its figures are timed afresh; figures older than
:data:`MAX_AGE_S` are timed afresh too. Figures within the day are checked by the probe's ranks
with one all-reduce before they are trusted (runtime/_cluster_probe.py), so a link shaped or
swapped within the day is timed again rather than believed.

It is a cache, never a source of truth: an unreadable, torn or foreign file reads as nothing kept,
and the file is replaced atomically, so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrun.config import KEPT_LINK_KEYS, kept_links_valid

__all__ = ["KeptLinks", "MAX_AGE_S", "cluster_key", "keep_links", "kept_links"]

#: Kept figures older than this are timed again (the issue's day).
MAX_AGE_S = 24 * 3600.0
_FOLDER = "links"


@dataclass(frozen=True)
class KeptLinks:
    """A cluster's timed links (``KEPT_LINK_KEYS``) and when (Unix time) they were timed."""

    figures: dict[str, Any]
    timed_at: float

    def age_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.timed_at)


def cluster_key(hosts: Sequence[tuple[str, str, int]], interface: str | None, device: str) -> str:
    """The name the figures of a job on ``hosts`` ((label, address, slots) in rank order) are kept by."""
    identity = json.dumps({"hosts": [list(host) for host in hosts], "interface": interface, "device": device},
                          sort_keys=True)
    return hashlib.sha256(identity.encode()).hexdigest()[:24]


def _path(home: str, key: str) -> Path:
    return Path(home).expanduser() / _FOLDER / f"{key}.json"


def kept_links(home: str, key: str, now: float | None = None) -> KeptLinks | None:
    """The figures kept under ``key`` if there are any younger than :data:`MAX_AGE_S`, else None."""
    try:
        data = json.loads(_path(home, key).read_text())
        kept = KeptLinks({name: data["figures"][name] for name in KEPT_LINK_KEYS}, float(data["timed_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return kept if kept_links_valid(kept.figures) and kept.age_s(now) < MAX_AGE_S else None


def keep_links(home: str, key: str, figures: dict[str, Any], now: float | None = None) -> Path | None:
    """Keep ``figures`` under ``key``, timed now; the file, or None where ``home`` is not writable (a
    cache that cannot be written costs the next probe its timing, never this job)."""
    path = _path(home, key)
    record = {"figures": {name: figures[name] for name in KEPT_LINK_KEYS},
              "timed_at": round(time.time() if now is None else now, 3)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(record))
        os.replace(partial, path)
    except OSError:
        return None
    return path
