"""Benchmark tables (plain values in, rich renderable out)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table


def render_overhead(report: Mapping[str, Any]) -> Table:
    table = Table(
        title=(f"overhead: {report['replicas']} replicas, {report['steps']} steps, "
               f"global batch {report['global_batch_size']}, median of {report['repeats']}"),
        title_justify="left",
    )
    for column in ("contender", "samples/s", "vs torchrun+ddp", "time to first step"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    rows: Sequence[Mapping[str, Any]] = report["rows"]
    for row in rows:
        table.add_row(row["name"], f"{row['samples_per_s']:.0f}", f"{row['vs_ddp']:.3f}x",
                      f"{row['time_to_first_step_s']:.2f}s")
    return table


def render_ttfs(report: Mapping[str, Any]) -> Table:
    table = Table(title=(f"time to first step: {report['world_size']} ranks, median of {report['repeats']}"),
                  title_justify="left")
    for column in ("contender", "time to first step", "speed-up vs cold torchrun"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for row in report["rows"]:
        table.add_row(row["name"], f"{row['time_to_first_step_s']:.2f}s", f"{row['speedup_vs_torchrun']:.2f}x")
    return table
