"""The dashboard's guard in isolation: every secret it compares goes through hmac.compare_digest
(a plain ``==`` returns at the first differing byte, which times out the token a byte at a time),
and odd input (another length, non-ASCII, a broken cookie) is a refusal, never an exception."""

from __future__ import annotations

import hmac

import pytest

from distrun.dashboard import _guard
from distrun.dashboard._guard import COOKIE, Guard

HOST = "127.0.0.1:8265"


@pytest.fixture
def compared(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, bytes]]:
    """Each pair the guard hands to hmac.compare_digest, which still decides."""
    calls: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return original(a, b)

    monkeypatch.setattr(_guard.hmac, "compare_digest", recording)
    return calls


def _check(guard: Guard, query: str = "", **headers: str) -> int:
    return guard.check("GET", "/", query, {"Host": HOST, **headers}).status


def test_the_token_the_bearer_and_the_cookie_are_compared_in_constant_time(compared):
    guard = Guard.for_address("127.0.0.1", 8265)
    assert _check(guard, f"token={guard.token}") == 303
    assert _check(guard, Authorization=f"Bearer {guard.token}") == 0
    assert _check(guard, Cookie=f"{COOKIE}={guard.session}") == 0
    secrets = {guard.token.encode(), guard.session.encode()}
    assert len(compared) == 3 and all(secret in secrets for _given, secret in compared), compared


@pytest.mark.parametrize("query, headers, status", [
    ("token=short", {}, 403),
    ("token=%C3%A9t%C3%A9", {}, 403),  # non-ASCII
    ("", {"Authorization": "Bearer " + "x" * 500}, 401),
    ("", {"Cookie": f"{COOKIE}=\"unterminated"}, 401),
    ("", {"Cookie": f"{COOKIE}=wrong"}, 401),
], ids=["shorter-token", "non-ascii-token", "long-bearer", "broken-cookie", "wrong-cookie"])
def test_a_wrong_secret_of_any_shape_is_refused_through_compare_digest(compared, query, headers, status):
    guard = Guard.for_address("127.0.0.1", 8265)
    assert _check(guard, query, **headers) == status
    assert len(compared) == (0 if "unterminated" in headers.get("Cookie", "") else 1), compared
