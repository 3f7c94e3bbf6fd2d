"""A job's events as its page's timeline: one line each for what changes the story of a run
(a rank started or failed, a checkpoint, a resume, an evaluation, a changed group, a diloco
sync, a slow or hung rank), none for the steady stream of steps, heartbeats and output lines.

Each line is written as the terminal's live view words it, so the page and the CLI agree.
"""

from __future__ import annotations

from typing import Any

from distrun.client._job_state import failure_message
from distrun.protocol import (
    AllReduceChosen,
    Checkpointed,
    Done,
    Eval,
    Event,
    Exited,
    Failed,
    Hung,
    MembershipChanged,
    Resumed,
    Started,
    Straggler,
    Synced,
)

__all__ = ["timeline_entry"]


def timeline_entry(event: Event, host: str) -> dict[str, Any] | None:
    """The event as a timeline line ({time, rank, host, kind, text}); None for one it leaves out."""
    text = _describe(event)
    if text is None:
        return None
    return {"time": event.time, "rank": event.rank, "host": host, "kind": event.type, "text": text}


def _describe(event: Event) -> str | None:  # noqa: PLR0911 - one answer per kind of event
    if isinstance(event, Started):
        return f"rank {event.rank} started on {event.device} (pid {event.pid})"
    if isinstance(event, Failed):
        return failure_message(event)
    if isinstance(event, Exited) and event.returncode != 0:
        return f"rank {event.rank} exited with {event.returncode}"
    if isinstance(event, Done):
        return f"rank {event.rank} finished after {event.steps} steps" + (f": {event.reason}" if event.reason else "")
    if isinstance(event, Checkpointed):
        return f"checkpoint at step {event.step}: {event.path} (training waited {event.blocked_ms:.0f} ms)"
    if isinstance(event, Resumed):
        return f"resumed from {event.path} at step {event.step}"
    if isinstance(event, Eval):
        metrics = ", ".join(f"{name} {value:.4g}" for name, value in sorted(event.metrics.items()))
        return f"eval at step {event.step}: {metrics}"
    if isinstance(event, MembershipChanged):
        left = f"; left: {', '.join(event.left)}" if event.left else ""
        joined = f"; joined: {', '.join(event.joined)}" if event.joined else ""
        return (f"group {event.generation}: {event.world_size} replica(s) from step {event.step}{left}{joined} "
                f"(recovered in {event.recovery_s:.1f} s)")
    if isinstance(event, Straggler):
        where = f" on {event.host}" if event.host else ""
        if event.recovered:
            return f"rank {event.rank}{where} keeps pace again"
        return (f"rank {event.rank}{where} is slow: {event.ratio:.2f}x the others' compute per step "
                f"({event.compute_ms:.0f} ms against {event.median_ms:.0f} ms)")
    if isinstance(event, Hung):
        return f"no rank has stepped for {event.stalled_s:.0f} s: {event.where}"
    if isinstance(event, Synced):
        fragment = f" (fragment {event.fragment + 1} of {event.fragments})" if event.fragments > 1 else ""
        return (f"sync {event.outer_step} at step {event.step}{fragment}: {event.bytes_sent / 1e6:,.1f} MB as "
                f"{event.dtype} in {event.seconds:.2f} s, {event.blocked_s:.2f} s of it waited")
    if isinstance(event, AllReduceChosen):
        return f"all-reduce: {event.algorithm} ({event.reason})"
    return None
