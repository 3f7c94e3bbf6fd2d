"""What the replicas' communication cost, folded into the live view's line and the summary's figures:
``--strategy diloco``'s syncs (the chief's Synced events) and ``--embeddings ps``'s bytes a step
(each replica's Step events)."""

from __future__ import annotations

from typing import Any

from distrun.protocol import Step, Synced

__all__ = ["SyncTally"]


class SyncTally:
    """Outer steps, and what every sync cost the chief: bytes sent and seconds its steps waited."""

    def __init__(self) -> None:
        self._last: Synced | None = None
        self._bytes = 0
        self._blocked_s = 0.0
        self._per_step: dict[int, tuple[float, float]] = {}  # --embeddings ps: rank -> (embedding, dense) bytes

    def add(self, event: Synced) -> None:
        self._last = event
        self._bytes += event.bytes_sent
        self._blocked_s += event.blocked_s

    def add_step(self, event: Step) -> None:
        """A replica's newest mean bytes a step (``--embeddings ps``; other Step events carry none)."""
        if event.embedding_bytes_per_step is not None:
            self._per_step[event.rank] = (event.embedding_bytes_per_step, event.dense_grad_bytes_per_step or 0.0)

    def _mean_per_step(self) -> tuple[float, float] | None:
        """(embedding, dense gradient) bytes a step, the mean over the replicas that said."""
        if not self._per_step:
            return None
        count = len(self._per_step)
        return (sum(e for e, _ in self._per_step.values()) / count, sum(d for _, d in self._per_step.values()) / count)

    def line(self) -> str | None:
        """``diloco: outer step 4 at step 40 · last sync 1.3 MB int8 in 0.12 s (0.02 s waited)``, or
        ``embeddings ps: a step moves 4.1 KB of rows pulled and pushed, 5.4 KB of dense gradients all-reduced``."""
        last = self._last
        if last is None:
            per_step = self._mean_per_step()
            return None if per_step is None else (
                f"embeddings ps: a step moves {_size(per_step[0])} of rows pulled and pushed, "
                f"{_size(per_step[1])} of dense gradients all-reduced (each replica)")
        part = f" (fragment {last.fragment + 1}/{last.fragments})" if last.fragments > 1 else ""
        return (f"diloco: outer step {last.outer_step} at step {last.step} · last sync{part} "
                f"{last.bytes_sent / 1e6:.2f} MB {last.dtype} in {last.seconds:.2f} s ({last.blocked_s:.2f} s waited)")

    def summary(self, diloco: bool) -> dict[str, Any]:
        """The summary's ``outer_steps``, ``sync_mb`` and ``sync_blocked_s`` (None unless diloco), and
        ``embedding_bytes_per_step`` and ``dense_grad_bytes_per_step`` (None unless --embeddings ps)."""
        per_step = self._mean_per_step()
        moved = {"embedding_bytes_per_step": per_step[0] if per_step else None,
                 "dense_grad_bytes_per_step": per_step[1] if per_step else None}
        if not diloco:
            return {"outer_steps": None, "sync_mb": None, "sync_blocked_s": None, **moved}
        return {"outer_steps": self._last.outer_step if self._last else 0, "sync_mb": round(self._bytes / 1e6, 3),
                "sync_blocked_s": round(self._blocked_s, 3), **moved}


def _size(count: float) -> str:
    """Bytes for the eye: ``512 B``, ``4.1 KB``, ``12.3 MB`` (decimal units)."""
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"
