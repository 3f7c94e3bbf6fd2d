"""One report from every rank's stack and Flight Recorder: what ``distrun stacks`` and
``--hang-timeout-s`` print (``ui/diagnosis`` collapses and draws it).

The Flight Recorder says, from the collectives' side, what the stacks say: every rank's
last collective, and which ranks never entered the one the others are waiting in. Pure
functions of what the hosts answered, so they are tested on their own.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from distrun.protocol import SERVER_RANK, Diagnosed
from distrun.protocol.diagnosis import CollectiveRecord, RankStack

__all__ = ["read_record", "awaited_and_missing", "build_diagnosis"]


def read_record(rank: int, host: str, raw: bytes | str) -> CollectiveRecord:
    """A rank's last collective from its Flight Recorder dump (torch's JSON)."""
    try:
        dump = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return CollectiveRecord(rank=rank, host=host, error="its dump is not JSON")
    if not isinstance(dump, dict):
        return CollectiveRecord(rank=rank, host=host, error="its dump is not a JSON object")
    if dump.get("error"):
        return CollectiveRecord(rank=rank, host=host, error=str(dump["error"])[:200])
    entries = [e for e in dump.get("entries") or () if isinstance(e, dict) and not e.get("is_p2p")]
    if not entries:
        return CollectiveRecord(rank=rank, host=host, error="no collective recorded")
    last = max(entries, key=lambda e: (int(e.get("time_created_ns") or 0), int(e.get("collective_seq_id") or 0)))
    group = last.get("process_group") or ["", ""]
    return CollectiveRecord(
        rank=rank, host=host, group=str(group[0]) if group else "", seq=int(last.get("collective_seq_id") or 0),
        op=str(last.get("profiling_name") or "?"), sizes=_sizes(last),
        completed=bool(last.get("retired")) or last.get("state") == "completed", recorded=len(entries))


def _sizes(entry: dict[str, Any]) -> str:
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    parts = [f"{list(size)} {dtype}" for size, dtype in zip(sizes, dtypes)]
    text = ", ".join(parts[:3]) + (f" (+{len(parts) - 3})" if len(parts) > 3 else "")
    return text[:120]


def awaited_and_missing(records: list[CollectiveRecord] | tuple[CollectiveRecord, ...]) -> tuple[str | None, tuple[int, ...]]:
    """The collective most unfinished ranks wait in (``"#5 gloo:all_reduce"``), and the ranks
    of its group whose last collective comes before it: they never entered it."""
    waiting = [r for r in records if r.seq is not None and not r.completed]
    if not waiting:
        return None, ()
    (group, seq), _ = Counter((r.group, r.seq) for r in waiting).most_common(1)[0]
    op = next(r.op for r in waiting if (r.group, r.seq) == (group, seq))
    behind = tuple(sorted(r.rank for r in records
                          if r.group == group and r.seq is not None and r.seq < seq))
    return f"#{seq} {op}" + (f" (group {group})" if group not in ("", "0") else ""), behind


def build_diagnosis(reason: str, stacks: list[RankStack], dumps: dict[tuple[int, str], bytes | None],
                    dump_dir: str | None) -> Diagnosed:
    """``dumps``: {(rank, host): its Flight Recorder dump, or None when it wrote none in time}."""
    records = [read_record(rank, host, raw) if raw is not None
               else CollectiveRecord(rank=rank, host=host, error="wrote no dump in time (holding the GIL?)")
               for (rank, host), raw in sorted(dumps.items())]
    awaited, missing = awaited_and_missing(records)
    return Diagnosed(rank=SERVER_RANK, time=time.time(), reason=reason, stacks=tuple(sorted(stacks, key=lambda s: s.rank)),
                     collectives=tuple(records), awaited=awaited, missing=missing, dump_dir=dump_dir)
