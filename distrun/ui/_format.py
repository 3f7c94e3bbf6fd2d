"""Number formatting shared by tables."""

from __future__ import annotations


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
