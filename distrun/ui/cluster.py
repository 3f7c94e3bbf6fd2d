"""The host table of `up`, `status` and `down`."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from distrun.protocol.cluster import ClusterReport, HostRow, HostStatus
from distrun.ui._format import fmt_seconds

_STYLE = {
    HostStatus.UP: "green", HostStatus.STARTED: "green", HostStatus.RESTARTED: "yellow",
    HostStatus.STOPPED: "green", HostStatus.NOT_RUNNING: "yellow", HostStatus.DOWN: "red", HostStatus.ERROR: "red",
}


def fmt_bytes(value: int) -> str:
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _devices(row: HostRow) -> str:
    info = row.server
    if info is None:
        return "-"
    if info.gpu_count:
        names = sorted(set(info.gpu_names))
        return f"{info.gpu_count}x {names[0]}" if len(names) == 1 else f"{info.gpu_count} GPUs"
    return f"CPU x{info.cpu_count}"


def render_cluster(report: ClusterReport) -> Group:
    """The table, then one note per host that has something to say (errors in full, never cut)."""
    notes = [Text.assemble((f"{row.host}: ", "bold"), (row.message, "" if row.status.healthy else _STYLE[row.status]))
             for row in report.rows if row.message]
    return Group(_table(report), *notes)


def _table(report: ClusterReport) -> Table:
    down = report.command == "down"
    live = report.command == "status"
    table = Table(title=f"cluster {report.cluster}: {report.command}", title_justify="left", box=box.SIMPLE_HEAD)
    columns = ("host", "roles") if down else (
        "host", "roles", "slots", "devices", "memory free", "version", "pid", "uptime",
        *(("rtt", "load", "jobs") if live else ()))
    host_width = max((len(row.host) for row in report.rows), default=0)
    for name in columns:  # host names are never cut: the other columns give way
        right = name in ("slots", "pid", "uptime", "rtt", "load", "jobs", "memory free")
        table.add_column(name, justify="right" if right else "left", no_wrap=True,
                         min_width=host_width if name == "host" else None)
    if down:
        table.add_column("left", justify="right")
    table.add_column("status")
    if any(row.message for row in report.rows):  # the * on a status: that host's note follows the table
        table.caption, table.caption_justify = "* see that host's note below", "left"
    for row in report.rows:
        status = Text(row.status.value + (" *" if row.message else ""), style=_STYLE[row.status])
        if down:
            left = "-" if row.processes_left is None else str(row.processes_left)
            table.add_row(row.host, ",".join(row.roles), left, status)
            continue
        info = row.server
        cells = [
            row.host, ",".join(row.roles),
            "-" if row.slots is None else str(row.slots),
            _devices(row),
            f"{fmt_bytes(info.memory_available_bytes)} / {fmt_bytes(info.memory_total_bytes)}" if info else "-",
            info.version if info else "-",
            str(info.pid) if info else "-",
            fmt_seconds(info.uptime_s) if info else "-",
        ]
        if live:
            cells += [
                f"{row.rtt_ms:.1f} ms" if row.rtt_ms is not None else "-",
                f"{info.load_1m:.2f}" if info else "-",
                str(info.jobs_running) if info else "-",
            ]
        table.add_row(*cells, status)
    return table


def _beside(theirs: str | None, ours: str | None, *, minor: bool = False) -> Text:
    """A host's version, with the client's beside it (in red) where a job's skew check would refuse it."""
    if not theirs:
        return Text("-")
    cut = (lambda v: v.split(".")[:2]) if minor else (lambda v: v.split("+")[0])
    if ours and cut(theirs) != cut(ours):
        return Text(f"{theirs} (client {ours})", style="red")
    return Text(theirs)


_DOCTOR_STYLE = {"ok": "green", "warn": "yellow", "problem": "red", "down": "red"}


def render_doctor(cluster: str, rows: list, links: list | None = None) -> Group:  # rows: client.doctor.DoctorRow
    """`distrun doctor`: one row per host, every problem and warning in full, then ``--links``' rates.

    Each host's environment and its Python and torch stand beside the client's (the title), and a
    version that differs from the client's says the client's in its cell: a job would be refused."""
    first = rows[0] if rows else None
    here = (f" (client: python {first.client_python or '?'}, torch {first.client_torch or '-'})"
            if first is not None and first.client_python else "")
    table = Table(title=f"cluster {cluster}: doctor{here}", title_justify="left", box=box.SIMPLE_HEAD)
    host_width = max((len(row.host) for row in rows), default=0)
    for name in ("host", "env", "installer", "python", "distrun", "torch", "cuda", "nccl", "gpus", "free", "clock",
                 "route to chief", "chief port", "status"):
        table.add_column(name, no_wrap=True, min_width=host_width if name == "host" else None,
                         justify="right" if name in ("gpus", "free", "clock") else "left")
    for row in rows:
        reach = "-" if row.reaches_chief is None else ("reached" if row.reaches_chief else "NOT reached")
        table.add_row(
            row.host, row.environment or "-", row.installer or "-", _beside(row.python, row.client_python, minor=True),
            row.distrun or "-", _beside(row.torch, row.client_torch), row.cuda or "-", row.nccl or "-",
            "-" if row.gpus is None else str(row.gpus),
            "-" if row.free_bytes is None else fmt_bytes(row.free_bytes),
            "-" if row.skew_s is None else f"{row.skew_s * 1000:+.0f} ms",
            row.interface or "-", reach, Text(row.status, style=_DOCTOR_STYLE[row.status]))
    notes = [Text.assemble((f"{row.host}: ", "bold"), (text, _DOCTOR_STYLE["problem" if problem else "warn"]))
             for row in rows for problem, texts in ((True, row.problems), (False, row.warnings)) for text in texts]
    parts: list = [table, *notes]
    if links:
        rates = Table(title="links (raw TCP, one pair at a time)", title_justify="left", box=box.SIMPLE_HEAD)
        for name in ("from", "to", "MB/s", "Mbit/s"):
            rates.add_column(name, justify="right" if "/" in name else "left", no_wrap=True)
        for link in links:
            rates.add_row(str(link["from"]), str(link["to"]), f"{link['MBps']:.1f}", f"{link['MBps'] * 8:.0f}")
        parts.append(rates)
    return Group(*parts)
