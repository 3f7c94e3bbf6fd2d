"""`distrun dashboard`: this machine's and its clusters' jobs, ranks and hosts on a web page."""

from __future__ import annotations

import ipaddress
import signal
import webbrowser
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import typer

from distrun.cli._app import app, stderr
from distrun.cli.cluster import distrun_home, resolve_cluster
from distrun.client.brought_up import brought_up
from distrun.client.history import kept_clusters
from distrun.errors import DistrunError

if TYPE_CHECKING:
    from distrun.dashboard import Sources

#: The port a dashboard takes unless told: TensorBoard's 6006 is often taken by TensorBoard.
DEFAULT_PORT = 6070


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _sources(cluster_file: Path | None) -> Sources:
    """CLUSTER alone; without it this machine's server first, then each cluster `up` recorded (one that no
    longer loads is shown with why, not dropped: a typo in one file hides no other cluster), then each
    cluster taken `down` from here, from the history `down` kept. CLUSTER is shown from its history
    where `up` has not recorded it since `down` kept one."""
    from distrun.dashboard import KeptSource, Source, Sources, Unloaded

    home = distrun_home()
    recorded = brought_up(home)
    up_at = {entry.file: entry.up_at for entry in recorded}
    # A history kept after the cluster's last `up` (a `down` that left a host unclean keeps the cluster
    # recorded as up, but its servers are gone all the same).
    kept = {cluster.file: cluster for cluster in kept_clusters(home) if cluster.kept_at > up_at.get(cluster.file, 0.0)}
    if cluster_file is not None:
        history = kept.get(str(cluster_file.expanduser().resolve()))
        return Sources((KeptSource(history) if history else Source.of(resolve_cluster(cluster_file)),))
    sources: list[Source | KeptSource] = [Source.of(resolve_cluster(None))]
    unloaded = []
    for entry in recorded:
        if entry.file in kept:
            continue
        try:
            sources.append(Source.of(resolve_cluster(Path(entry.file))))
        except DistrunError as exc:
            unloaded.append(Unloaded(entry.name, entry.file, exc.message))
    sources.extend(KeptSource(history) for history in kept.values())
    return Sources(tuple(sources), tuple(unloaded))


@app.command()
def dashboard(
    cluster_file: Path | None = typer.Argument(None, metavar="[CLUSTER]",
                                               help="The cluster file: that cluster only; none: this machine's jobs (while `distrun up` runs here) and every cluster `distrun up` brought up from here."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="The port to serve on (0: any free port)."),
    host: str = typer.Option("127.0.0.1", "--host", metavar="ADDR",
                             help="The address to listen on; anything but loopback lets the network reach the page (the token still guards it)."),
    no_browser: bool = typer.Option(False, "--no-browser", help="Print the URL only; do not open a browser."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Serve a page of the jobs (their ranks, charts, logs, stacks; cancel) until Ctrl-C."""
    from distrun.dashboard import Dashboard  # here: `distrun --help` does not pay for http.server

    if not _loopback(host):
        stderr.print(f"warning: --host {host}: the dashboard listens beyond this machine; anyone who can reach "
                     "it and has the URL's token can cancel jobs (docs/dashboard.md: an `ssh -L` tunnel keeps it "
                     "on loopback)", markup=False)
    page = Dashboard.bind(_sources(cluster_file), host, port)

    def _stop(_signum: int, _frame: FrameType | None) -> None:
        page.stop()

    signal.signal(signal.SIGTERM, _stop)
    typer.echo(f"distrun dashboard: {page.url}")
    stderr.print("Ctrl-C stops it", markup=False, style="dim")
    if not no_browser:
        webbrowser.open(page.url)
    try:
        page.serve()
    except KeyboardInterrupt:
        pass
    stderr.print("dashboard stopped", markup=False)
