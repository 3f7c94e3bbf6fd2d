"""Number formatting shared by tables."""

from __future__ import annotations

from distrun.protocol import SERVER_RANK


def fmt_loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def fmt_rate(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:.1f}k"
    return f"{value:.1f}"


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 60:
        return f"{value:.1f}s"
    minutes, seconds = divmod(int(value), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def fmt_ranks(ranks: tuple[int, ...] | list[int]) -> str:
    """``rank 3``, ``ranks 0-3``, ``ranks 0-1,4``: runs of consecutive ranks joined."""
    ordered = sorted(set(ranks))
    if ordered == [SERVER_RANK]:
        return "server"  # a note the worker server wrote into the job's log
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    runs: list[str] = []
    start = prev = ordered[0]
    for rank in ordered[1:] + [None]:  # type: ignore[list-item]
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return "ranks " + ",".join(runs)
