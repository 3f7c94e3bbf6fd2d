"""Who may talk to the dashboard: the first check of every request, before any route runs.

The page can cancel jobs, so it is guarded like a worker server, not like a static site:
Ray's dashboard answered anyone on the network for years, and an advisory followed. Every
request needs the token that was printed once (in the URL, or ``Authorization: Bearer``);
the browser trades it for an HttpOnly, SameSite=Strict cookie so that the token leaves the
address bar, and a page on another site can neither read the cookie nor have it sent.
``Host`` must name this server (a DNS-rebinding page's requests carry its own name), and a
request that carries an ``Origin`` must come from this server's own; a POST must carry one.
Secrets are compared in constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hmac
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs

__all__ = ["Guard", "Verdict", "COOKIE", "LOOPBACK"]

COOKIE = "distrun_dashboard"
LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


@dataclass(frozen=True)
class Verdict:
    """What the guard decided: ``status`` 0 lets the request through; a 303 trades the token for
    the cookie (``location``, ``set_cookie``); 401 and 403 refuse it with ``reason`` (one line,
    never job data)."""

    status: int = 0
    reason: str = ""
    location: str | None = None
    set_cookie: str | None = None


@dataclass(frozen=True)
class Guard:
    """The dashboard's secrets and the names it answers to. ``hosts``: the ``Host`` values
    (name:port) a request may carry; each also makes the one ``Origin`` accepted."""

    hosts: frozenset[str]
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    session: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    @classmethod
    def for_address(cls, bind: str, port: int, names: tuple[str, ...] = ()) -> Guard:
        """The loopback names always; ``bind`` and ``names`` too when the server listens beyond them,
        and on a wildcard address (0.0.0.0, ::) this machine's names and addresses."""
        wildcard = bind in ("0.0.0.0", "::", "")
        every = (*LOOPBACK, *(machine_names() if wildcard else (bind,)), *names)
        hosts = {f"[{name}]:{port}" if ":" in name and not name.startswith("[") else f"{name}:{port}"
                 for name in every if name}
        return cls(frozenset(hosts))

    def check(self, method: str, path: str, query: str, headers: Mapping[str, str]) -> Verdict:
        host = headers.get("Host") or ""
        if host not in self.hosts:
            return Verdict(403, "forbidden: this dashboard does not answer to that Host")
        origin = headers.get("Origin")
        if origin is not None and origin != f"http://{host}":
            return Verdict(403, "forbidden: a request from another origin")
        if method == "POST" and origin is None:
            return Verdict(403, "forbidden: an action needs the page's Origin")
        given = parse_qs(query).get("token")
        if given:
            if not _same(given[0], self.token):
                return Verdict(403, "forbidden: wrong token")
            cookie = f"{COOKIE}={self.session}; HttpOnly; SameSite=Strict; Path=/"
            return Verdict(303, location=path, set_cookie=cookie)
        if self._bearer(headers) or self._cookie(headers):
            return Verdict()
        return Verdict(401, "unauthorized: open the URL `distrun dashboard` printed (it holds the token)")

    def _bearer(self, headers: Mapping[str, str]) -> bool:
        value = headers.get("Authorization") or ""
        return value.startswith("Bearer ") and _same(value[len("Bearer "):], self.token)

    def _cookie(self, headers: Mapping[str, str]) -> bool:
        jar = SimpleCookie()
        try:
            jar.load(headers.get("Cookie") or "")
        except CookieError:
            return False
        morsel = jar.get(COOKIE)
        return morsel is not None and _same(morsel.value, self.session)


def machine_names() -> tuple[str, ...]:
    """What a browser elsewhere may call this machine: its host name, full name, and addresses."""
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        names |= {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:  # no address for its own name (a container's): the names still count
        pass
    return tuple(sorted(names))


def _same(given: str, secret: str) -> bool:
    """Constant-time equality of two strings, however long or odd ``given`` is."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), secret.encode())
