"""Splitting non-blocking pipe reads into lines, with a cap on line length."""

from __future__ import annotations

MAX_LINE_BYTES = 1 << 20


class LineBuffer:
    """Accumulates bytes and yields complete lines (without the newline).

    A line longer than MAX_LINE_BYTES is cut into pieces rather than buffered
    without bound: a recipe printing a huge line must not exhaust the launcher.
    """

    def __init__(self) -> None:
        self._pending = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._pending += data
        lines: list[bytes] = []
        while True:
            cut = self._pending.find(b"\n")
            if cut < 0:
                break
            lines.append(bytes(self._pending[:cut]))
            del self._pending[: cut + 1]
        while len(self._pending) > MAX_LINE_BYTES:
            lines.append(bytes(self._pending[:MAX_LINE_BYTES]))
            del self._pending[:MAX_LINE_BYTES]
        return lines

    def flush(self) -> list[bytes]:
        rest, self._pending = bytes(self._pending), bytearray()
        return [rest] if rest else []
