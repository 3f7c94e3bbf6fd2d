"""The host table of up/status/down, as a user reads it at 80 columns."""

from __future__ import annotations

from rich.console import Console

from distrun.protocol.cluster import ClusterReport, HostRow, HostStatus
from distrun.ui import render_cluster


def _text(report: ClusterReport) -> str:
    console = Console(width=80, record=True, color_system=None)
    console.print(render_cluster(report))
    return console.export_text()


def test_a_starred_status_says_what_the_star_means_and_the_note_follows() -> None:
    report = ClusterReport("lab", "down", (
        HostRow("10.0.0.1", ("chief", "worker"), HostStatus.STOPPED, processes_left=0),
        HostRow("10.0.0.2", ("worker",), HostStatus.NOT_RUNNING, message="no worker server was running",
                processes_left=0),
    ))
    text = _text(report)
    assert "not running *" in text and "* see that host's note below" in text
    assert text.index("* see that host's note below") < text.index("10.0.0.2: no worker server was running")


def test_without_a_note_there_is_no_star_and_no_legend() -> None:
    report = ClusterReport("lab", "down", (HostRow("10.0.0.1", ("worker",), HostStatus.STOPPED, processes_left=0),))
    text = _text(report)
    assert "*" not in text
