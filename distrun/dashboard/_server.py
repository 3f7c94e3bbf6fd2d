"""The dashboard's HTTP server: the standard library's ThreadingHTTPServer, one thread a request.

No framework: the page is a handful of routes, static files shipped in the package, and two
server-sent-event streams, and the standard library does that without a dependency. Every
request passes the ``Guard`` first (in ``handle_one_request``'s only entry, not per route);
every answer carries the CSP ``default-src 'self'`` and no CORS header, ever.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import unquote, urlsplit

from distrun.dashboard._guard import Guard
from distrun.dashboard._host_history import SAMPLE_EVERY_S, HostHistory
from distrun.dashboard._sources import Sources
from distrun.errors import DistrunError, UsageError

__all__ = ["Dashboard", "PAGES"]

#: Paths that answer with the page (the script draws the view the path names).
PAGES = ("/", "/hosts")
_STATIC = {"/static/app.js": ("app.js", "text/javascript"), "/static/charts.js": ("charts.js", "text/javascript"),
           "/static/style.css": ("style.css", "text/css"), "/static/favicon.svg": ("favicon.svg", "image/svg+xml")}
#: How long an event stream waits for news before a keep-alive comment, and the jobs stream between looks.
_KEEPALIVE_S = 15.0
#: A job's page gets at most one update per this, each with everything new since the last: the
#: browser redraws its charts and rank rows per update, and drawing one per step event took 14%
#: of a core beside the ranks it watched, two a second 5% (docs/dashboard.md, "What it costs
#: training"). Once a second is as live as a person reads, and what TensorBoard's 30 s is not.
_UPDATE_EVERY_S = 1.0
_JOBS_EVERY_S = 1.0
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _asset(name: str) -> bytes:
    return resources.files("distrun.dashboard").joinpath("static", name).read_bytes()


@dataclass(frozen=True)
class Dashboard:
    """The server, bound; ``serve()`` until ``stop()`` (another thread, or a signal handler's)."""

    httpd: ThreadingHTTPServer
    guard: Guard
    source: Sources
    stopping: threading.Event
    history: HostHistory

    @classmethod
    def bind(cls, source: Sources, host: str, port: int, names: tuple[str, ...] = ()) -> Dashboard:
        """Listen on ``host``:``port`` (0: any free port); ``names``: other Host names it answers to."""
        try:
            httpd = _Server((host, port), _Handler)
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port "
                             "(0: any free port)") from None
        bound = httpd.server_address[1]
        dashboard = cls(httpd, Guard.for_address(host, bound, names), source, threading.Event(), HostHistory())
        httpd.dashboard = dashboard
        return dashboard

    @property
    def url(self) -> str:
        """The one URL to open: it holds the token, which the page trades for a cookie."""
        host = self.httpd.server_address[0]
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else f"[{host}]" if ":" in str(host) else host
        return f"http://{shown}:{self.httpd.server_address[1]}/?token={self.guard.token}"

    def serve(self) -> None:
        """Answer requests until ``stop()``; then close every watch and the socket."""
        thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                  name="dashboard-http", daemon=True)
        thread.start()
        sampler = threading.Thread(target=self._sample, name="dashboard-hosts", daemon=True)
        sampler.start()
        try:
            while not self.stopping.wait(0.2):
                pass
        finally:
            self.stopping.set()
            self.httpd.shutdown()
            sampler.join(1)  # before the sources close; a host slow to answer is given up (a daemon)
            self.source.close()
            self.httpd.server_close()
            thread.join(5)

    def stop(self) -> None:
        self.stopping.set()

    def hosts(self) -> dict[str, Any]:
        """Every host as `distrun status` sees it now, recorded, with each one's history."""
        answer = self.source.hosts()
        self.history.record(answer["hosts"])
        return self.history.with_history(answer)

    def _sample(self) -> None:
        """The hosts' readings whenever no page asked for :data:`SAMPLE_EVERY_S`, so that their
        charts cover the time before a page was opened. Nothing it meets ends it: a cluster
        that does not answer is the page's to say, when it asks."""
        while not self.stopping.wait(max(0.0, SAMPLE_EVERY_S - self.history.idle_s())):
            if self.history.idle_s() < SAMPLE_EVERY_S:
                continue
            try:
                self.hosts()
            except Exception:  # noqa: BLE001 - see above; the next period asks again
                self.history.record([])  # counted as asked: no retry loop against a failing cluster


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # an open event stream never holds the exit
    allow_reuse_address = True
    dashboard: Dashboard


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "distrun-dashboard"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Quiet: the terminal shows the URL, not one line per request."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._refuse(HTTPStatus.METHOD_NOT_ALLOWED, "method not allowed")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._refuse(HTTPStatus.METHOD_NOT_ALLOWED, "method not allowed")

    do_DELETE = do_PATCH = do_OPTIONS = do_PUT  # noqa: N815 - no CORS preflight is ever answered

    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        dashboard = self.server.dashboard
        verdict = dashboard.guard.check(method, path, parts.query, self.headers)
        if verdict.status == 303:
            self.send_response(303)
            self.send_header("Location", path if path.startswith("/") and not path.startswith("//") else "/")
            self.send_header("Set-Cookie", verdict.set_cookie or "")
            self._common_headers(0)
            return
        if verdict.status:
            self._refuse(HTTPStatus(verdict.status), verdict.reason)
            return
        try:
            self._route(method, path, dashboard)
        except UsageError as exc:
            self._json({"error": exc.message}, HTTPStatus.NOT_FOUND)
        except DistrunError as exc:
            self._json({"error": exc.message}, HTTPStatus.BAD_GATEWAY)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the page went away mid-answer

    def _route(self, method: str, path: str, dashboard: Dashboard) -> None:
        source = dashboard.source
        if method == "GET" and (path in PAGES or path.startswith("/jobs/")):
            self._send(_asset("index.html"), "text/html; charset=utf-8")
        elif method == "GET" and path in _STATIC:
            name, kind = _STATIC[path]
            self._send(_asset(name), kind)
        elif method == "GET" and path == "/api/jobs":
            self._json(source.jobs())
        elif method == "GET" and path == "/api/jobs/events":
            self._jobs_stream(dashboard)
        elif method == "GET" and path == "/api/hosts":
            self._json(dashboard.hosts())
        elif path.startswith("/api/jobs/"):
            job_id, _, action = path[len("/api/jobs/"):].partition("/")
            if method == "GET" and action == "":
                update = source.watch(job_id).read(None)
                self._json(update.to_dict() if update is not None else {})
            elif method == "GET" and action == "events":
                self._job_stream(dashboard, job_id)
            elif method == "POST" and action == "cancel":
                self._json({"job": job_id, "cancelled_on": source.cancel(job_id)})
            elif method == "POST" and action == "stacks":
                self._json(source.stacks(job_id))
            else:
                self._refuse(HTTPStatus.NOT_FOUND, "no such page")
        else:
            self._refuse(HTTPStatus.NOT_FOUND, "no such page")

    # -- server-sent events

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self._common_headers(None)

    def _event(self, data: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")
        self.wfile.flush()

    def _job_stream(self, dashboard: Dashboard, job_id: str) -> None:
        """The job's page: everything first (``reset``), then what is new; closed after the job's end
        (the page stops listening then)."""
        watch = dashboard.source.watch(job_id)
        self._start_stream()
        cursor = None
        last = time.monotonic()
        while not dashboard.stopping.is_set():
            update = watch.read(cursor, wait_s=1.0 if cursor is not None else 0.0)
            if update is not None:
                cursor = update.cursor
                self._event(update.to_dict())
                last = time.monotonic()
                if update.head["ended"]:
                    return
                dashboard.stopping.wait(_UPDATE_EVERY_S)
            elif time.monotonic() - last > _KEEPALIVE_S:
                self.wfile.write(b": keep-alive\n\n")
                self.wfile.flush()
                last = time.monotonic()

    def _jobs_stream(self, dashboard: Dashboard) -> None:
        """The jobs page: the list again whenever it changed, looked at once a second."""
        self._start_stream()
        sent: dict[str, Any] | None = None
        last = time.monotonic()
        while not dashboard.stopping.is_set():
            try:
                now = dashboard.source.jobs()
            except DistrunError as exc:
                now = {"cluster": dashboard.source.name, "jobs": [], "unreachable": [], "error": exc.message}
            if now != sent:
                self._event(now)
                sent, last = now, time.monotonic()
            elif time.monotonic() - last > _KEEPALIVE_S:
                self.wfile.write(b": keep-alive\n\n")
                self.wfile.flush()
                last = time.monotonic()
            dashboard.stopping.wait(_JOBS_EVERY_S)

    # -- plain answers

    def _common_headers(self, length: int | None) -> None:
        for name, value in _HEADERS.items():
            self.send_header(name, value)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _send(self, body: bytes, kind: str, status: HTTPStatus = HTTPStatus.OK) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self._common_headers(len(body))
        self.wfile.write(body)

    def _json(self, data: dict[str, Any], status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(json.dumps(data).encode(), "application/json", status)

    def _refuse(self, status: HTTPStatus, reason: str) -> None:
        """One line of why, and nothing of the cluster's."""
        self._send(f"{status.value} {reason}\n".encode(), "text/plain; charset=utf-8", status)
